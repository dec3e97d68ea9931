"""`close()` is bounded on every path, a hung read included (issue 42, item 4): at most its
`flush_timeout` plus `KVTier.shutdown_timeout`, the copies still running abandoned and logged by
name. On 7e6c7c1 a `load()` blocked in a file read held `close(flush_timeout=3)` for as long as the
read (95 s on a dead mount): the worker plane's shutdown waited for its thread pool."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_nothing_lost import cpu_over_file, keys, make_kv  # noqa: E402

from kvtier.core.errors import ClosedError  # noqa: E402
from kvtier.standalone import KVTier  # noqa: E402

pytest.importorskip("torch")

HANG_S = 30.0  # how long the hung read lasts unless the test releases it (the old code waited for it)


def test_close_returns_within_its_bound_while_a_file_read_hangs(tmp_path, caplog):
    kv = make_kv(32)
    ks = keys(12)
    tier = KVTier.open(cpu_over_file(tmp_path / "nvme", cpu_blocks=4), kv, model="test/close")
    released = threading.Event()
    try:
        assert tier.store(ks, list(range(12)))
        assert tier.flush() == 0  # ks[:8] are in the file tier only
        disk = tier.hierarchy.manager.tiers[1].backend
        reading = threading.Event()

        def hung_read(*args, **kwargs):  # a read blocked in the kernel (dead NFS or FUSE mount)
            reading.set()
            released.wait(HANG_S)
            raise OSError(5, "Input/output error")

        disk.read_blocks = hung_read
        outcome: list[object] = []
        loader = threading.Thread(target=lambda: outcome.append(_load(tier, ks[:4])))
        loader.start()
        assert reading.wait(10), "the load never reached the file tier"
        tier.shutdown_timeout = 1.0
        caplog.set_level(logging.ERROR, logger="kvtier")
        start = time.monotonic()
        tier.close(flush_timeout=0.5)
        elapsed = time.monotonic() - start
        assert elapsed < 0.5 + 1.0 + 1.5, f"close() took {elapsed:.1f} s while a read hung"
        loader.join(5)
        assert outcome and isinstance(outcome[0], ClosedError)  # the waiting call ended
        assert any("abandoned" in r.getMessage() and "FileLoadStoreSpec" in r.getMessage() for r in caplog.records)
    finally:
        released.set()
        tier.close()


def _load(tier: KVTier, ks: list[bytes]) -> object:
    try:
        return tier.load(ks, list(range(20, 24)))
    except ClosedError as exc:
        return exc


def test_close_returns_within_its_bound_while_a_sync_hangs(tmp_path, caplog, monkeypatch):
    """A hung fdatasync (a dead disk) held `close()` for as long as it hung: closing the file
    backend waited for its syncer thread and synced the journal without a deadline. Found at
    3538333 (close not returned after 15 s)."""
    kv = make_kv(32)
    tier = KVTier.open(cpu_over_file(tmp_path / "nvme", cpu_blocks=4), kv, model="test/close")
    released, syncing = threading.Event(), threading.Event()
    try:
        assert tier.store(keys(12), list(range(12)))
        assert tier.flush() == 0
        real = os.fdatasync

        def hung_sync(fd: int) -> None:
            syncing.set()
            released.wait(HANG_S)
            real(fd)

        monkeypatch.setattr(os, "fdatasync", hung_sync)
        tier.shutdown_timeout = 1.0
        caplog.set_level(logging.ERROR, logger="kvtier")
        start = time.monotonic()
        tier.close(flush_timeout=0.5)
        elapsed = time.monotonic() - start
        assert syncing.is_set(), "closing the file tier never synced"
        assert elapsed < 0.5 + 1.0 + 1.5, f"close() took {elapsed:.1f} s while a sync hung"
        assert any("abandoned the backends of tiers nvme" in r.getMessage() for r in caplog.records)
    finally:
        released.set()
        tier.close()
