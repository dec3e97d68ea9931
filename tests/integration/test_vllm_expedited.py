"""Expedited loads (vLLM 0.33's `submit_load(..., expedited=True)`) in kvtier's vLLM worker, no engine.

An expedited load is one the engine waits for within the step; vLLM 0.33's own CPU worker runs
them on a handler of their own so they never queue behind regular loads. kvtier's worker runs them
on its expedited lane. Here another job's copy is held (the KV layout's scatter/gather waits on an
event on the thread that runs it): a regular load, or a store; the expedited load must still be
submitted, finish and land its bytes meanwhile. Runs under vLLM 0.32 and 0.33 alike: it calls
kvtier's worker directly.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_spec import _config  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

PAGE = 1024  # bytes per engine block of the one KV tensor
WAIT = 10.0  # generous bound for a background thread's step on a loaded machine


def _spec(tmp_path):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    tiers = {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "8 blocks"}]}
    return KVTierOffloadingSpec(_config(tmp_path, events=False, kvtier_config=tiers,
                                        engine_id=f"expedite-{time.time_ns()}", page=PAGE, blocks_per_chunk=1))


@dataclass
class Stored:
    """A worker whose engine blocks 0..3 were stored into CPU slots `cpu`, then zeroed."""

    worker: Any
    manager: Any
    engine: Any  # the engine's one KV tensor, 8 blocks
    original: Any  # its bytes before the zeroing
    cpu: Any  # the CPU spec of blocks 0..3

    def part(self, start: int, stop: int) -> Any:
        """The CPU spec of stored blocks `start..stop-1`."""
        from kvtier.integrations.vllm import KVTierCPULoadStoreSpec

        cpu = self.cpu
        return KVTierCPULoadStoreSpec(list(cpu.block_ids)[start:stop], cpu.tier, cpu.region)


def _gpu(*blocks: int) -> Any:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(list(blocks), group_sizes=[len(blocks)], block_indices=[0])


@pytest.fixture
def stored(tmp_path):
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, ReqContext

    spec = _spec(tmp_path)
    manager = spec.get_manager()
    engine = torch.randint(-128, 127, (8, PAGE), dtype=torch.int8)
    original = engine.clone()
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(engine, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])
    worker = spec.get_worker(caches)
    cpu = manager.prepare_store(_keys(0, 4), ReqContext("r")).store_spec
    assert worker.submit_store(1, _gpu(0, 1, 2, 3), cpu)
    worker.wait({1})
    assert [r.success for r in worker.get_finished()] == [True]
    engine.zero_()
    yield Stored(worker, manager, engine, original, cpu)
    worker.shutdown()
    manager.shutdown()


def _keys(start: int, stop: int) -> list[Any]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, stop)]


def _hold_copies_on(thread_name: str, monkeypatch) -> threading.Event:
    """Make every KV copy (scatter: the engine side of a load; gather: of a store) that runs on
    the thread `thread_name` wait until the returned event is set; other threads' run at once."""
    from kvtier.transfer.handlers.kv_layout import KVLayout

    release = threading.Event()
    for name in ("scatter", "gather"):
        real = getattr(KVLayout, name)

        def held(self, *args, _real=real, **kwargs):
            if threading.current_thread().name == thread_name:
                release.wait(WAIT)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(KVLayout, name, held)
    return release


def _regular_load(stored: Stored) -> tuple[int, Any, tuple]:
    """A regular load of stored blocks 0,1 into engine blocks 0,1."""
    return 10, stored.worker.submit_load, (10, stored.part(0, 2), _gpu(0, 1))


def _store(stored: Stored) -> tuple[int, Any, tuple]:
    """A store of engine blocks 4,5 (zeros) into two fresh CPU slots."""
    from vllm.v1.kv_offload.base import ReqContext

    fresh = stored.manager.prepare_store(_keys(10, 12), ReqContext("s")).store_spec
    return 20, stored.worker.submit_store, (20, _gpu(4, 5), fresh)


@pytest.mark.parametrize("blocker", [_regular_load, _store], ids=["behind-a-regular-load", "behind-a-store"])
def test_an_expedited_load_does_not_wait_for_a_running_job(stored, monkeypatch, blocker):
    """While another job's copy is held, an expedited load of blocks 2,3 is submitted, copied and
    its bytes land; the held job finishes after, and both report success."""
    import torch

    release = _hold_copies_on("held", monkeypatch)
    held_id, submit, args = blocker(stored)
    held = threading.Thread(name="held", target=submit, args=args)
    expedited = threading.Thread(target=stored.worker.submit_load, args=(11, stored.part(2, 4), _gpu(2, 3)),
                                 kwargs={"expedited": True})
    engine, original = stored.engine, stored.original
    try:
        held.start()
        time.sleep(0.2)  # the held job is now inside its copy
        expedited.start()
        expedited.join(WAIT / 2)
        assert not expedited.is_alive(), "the expedited load waited for the held job's copy"
        # (On CPU KV caches a copy runs inside `submit_load`: its return means the bytes are in.)
        assert torch.equal(engine[2:4], original[2:4]) and not engine[0:2].any()
        assert held.is_alive()
    finally:
        release.set()
        held.join(WAIT)
    stored.worker.wait({held_id, 11})
    assert {r.job_id: r.success for r in stored.worker.get_finished()} == {held_id: True, 11: True}
    assert torch.equal(engine[2:4], original[2:4])


def test_a_regular_load_still_runs_on_the_regular_plane(stored):
    """`expedited=False` (and vLLM 0.32, which never passes it) loads as before: bytes and report."""
    import torch

    assert stored.worker.submit_load(12, stored.part(0, 4), _gpu(0, 1, 2, 3), expedited=False)
    stored.worker.wait({12})
    assert [(r.job_id, r.success) for r in stored.worker.get_finished()] == [(12, True)]
    assert torch.equal(stored.engine[:4], stored.original[:4]) and not stored.engine[4:].any()
