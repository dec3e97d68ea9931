"""What vLLM's offloading connector does with a failed transfer: the assumption behind verifying
file-tier blocks on the scheduler side (during promotion) instead of in the worker.

kvtier verifies a file-tier block before `lookup` answers HIT, because a worker that found a bad
block could only report its load job as failed, and vLLM 0.32's `OffloadingConnectorWorker`
asserts that every transfer succeeded (docs/vllm.md, "Measured"): the engine stops, nothing is
recomputed. If this test starts failing, vLLM has learnt to recover from a failed load, and the
direct path (file tier -> KV cache from the worker, one copy, no RETRY) becomes possible.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


class _FailedLoadWorker:
    """An `OffloadingWorker` whose one finished job is a failed load."""

    def get_finished(self):
        from vllm.v1.kv_offload.base import TransferResult

        return [TransferResult(7, False, 0, 0.0)]


def test_a_failed_load_is_not_recovered_by_the_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    # The connector's worker side, past its constructor (which needs a whole engine config): only
    # the state `get_finished` reads.
    side = object.__new__(OffloadingConnectorWorker)
    side.worker = _FailedLoadWorker()
    side._load_jobs = {7: "request-1"}
    side._connector_worker_meta = None
    with pytest.raises(AssertionError):
        side.get_finished(set())
    # Nor does the connector report failed blocks or requests another way (the scheduler's
    # `kv_load_failure_policy` acts on those only).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert OffloadingConnector.get_block_ids_with_load_errors is KVConnectorBase_V1.get_block_ids_with_load_errors
    assert OffloadingConnector.get_transfer_results is KVConnectorBase_V1.get_transfer_results
