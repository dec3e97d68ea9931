"""A server or disk that keeps failing fails every job: the router logs the first failure of each
kind of error as a WARNING and the rest at DEBUG, and counts them all (issue 26 item 8: one WARNING,
not one per request)."""

from __future__ import annotations

import logging

from kvtier.core.types import TransferResult
from kvtier.transfer.router import TransferRouter


def test_failed_jobs_log_one_warning_per_kind_of_error(caplog):
    caplog.set_level(logging.DEBUG, logger="kvtier.transfer.router")
    router = TransferRouter()
    for job_id in range(5):
        router.finished.append(TransferResult(job_id, False, error="RemoteUnavailable: 127.0.0.1:1: TimeoutError"))
    router.finished.append(TransferResult(9, False, error="OSError: [Errno 5] Input/output error"))
    router.finished.append(TransferResult(10, True, 4096, 0.001))
    assert [r.job_id for r in router.poll()] == [0, 1, 2, 3, 4, 9, 10]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "transfer job 0 failed: RemoteUnavailable" in warnings[0] and "OSError" in warnings[1]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4, "the later ones are still logged"
    assert router.failed_jobs == {"RemoteUnavailable": 5, "OSError": 1}
