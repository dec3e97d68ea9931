"""One builder, two planes: the manager's router runs tier-to-tier jobs, the worker plane the jobs
that touch the KV caches; neither collects the other's results, and the worker plane hands out a
job's result as soon as its handler reports it."""

from __future__ import annotations

import threading

import pytest
from conftest import keys

from kvtier import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    build_hierarchy,
    load_config_text,
)
from kvtier.core.types import TransferResult
from kvtier.transfer import registry
from kvtier.transfer.handlers.base import SyncHandler, ThreadedHandler, TransferHandler
from kvtier.transfer.planes import WorkerPlane
from kvtier.transfer.router import TransferRouter

PAGE = 256
TWO_MEMORY_TIERS = """
block_bytes: 512B
tiers:
  - {name: hot, backend: memory, capacity: 4 blocks}
  - {name: warm, backend: memory, capacity: 16 blocks}
"""


def make_kv(num_blocks=8):
    torch = pytest.importorskip("torch")
    tensors = [torch.arange(num_blocks * PAGE, dtype=torch.int32).to(torch.int8).reshape(num_blocks, PAGE) + i
               for i in range(2)]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                             [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]])


class Gated(ThreadedHandler):
    """Copies nothing; each job finishes on a pool thread once `gate` is set."""

    def __init__(self):
        super().__init__(num_threads=1)
        self.gate = threading.Event()
        self.stopped = False

    def shutdown(self):
        self.stopped = True
        super().shutdown()

    def copy(self, src, dst):
        assert self.gate.wait(30)
        return 7


class Instant(SyncHandler):
    def copy(self, src, dst):
        return 1


class Silent(TransferHandler):
    """Accepts jobs and never reports them (a hung device); `report` hands a result to the router
    as a device would (the callback the router bound)."""

    def bind(self, on_done):
        super().bind(on_done)
        self.report = on_done

    def submit(self, job_id, src, dst):
        return


class CountingRouter(TransferRouter):
    def __init__(self):
        super().__init__()
        self.polls = 0

    def poll(self):
        self.polls += 1
        return super().poll()


def plane_with(handler):
    router = CountingRouter()
    router.register(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    return WorkerPlane(router), router


def gpu_to_cpu(plane):
    return plane.submit(GPULoadStoreSpec([0]), CPULoadStoreSpec([0], tier="cpu"))


def test_result_sleeps_until_the_handler_reports():
    """`result` blocks on the router's condition, not in a poll loop: a job finishing 0.3 s later on
    another thread is returned after a handful of polls, however long it ran."""
    handler = Gated()
    plane, router = plane_with(handler)
    job = gpu_to_cpu(plane)
    threading.Timer(0.3, handler.gate.set).start()
    result = plane.result(job, timeout=30)
    assert result.job_id == job and result.success and result.transfer_size == 7
    assert router.polls <= 3
    plane.shutdown()


def test_result_keeps_other_results_for_poll():
    plane, _ = plane_with(Instant())
    first, second, third = gpu_to_cpu(plane), gpu_to_cpu(plane), gpu_to_cpu(plane)
    assert plane.result(second).job_id == second
    assert sorted(r.job_id for r in plane.poll()) == [first, third]
    assert plane.poll() == []


def test_two_threads_waiting_in_result_each_get_their_own_job():
    """Issue 30: two jobs report together while two threads wait in `result`, one for each; the
    first thread to wake collects both reports. The other must be woken and get its own (on main it
    slept on "some report waiting" for ever: the report it wanted was already collected)."""
    silent = Silent()
    plane, router = plane_with(silent)
    first, second = gpu_to_cpu(plane), gpu_to_cpu(plane)
    got: dict[int, int] = {}
    waiters = [threading.Thread(target=lambda j=j: got.update({j: plane.result(j, timeout=10).job_id}), daemon=True)
               for j in (first, second)]
    for waiter in waiters:
        waiter.start()
    threading.Event().wait(0.2)  # both are asleep in `result` by now
    with router.reported:  # both reports land before either waiter runs again
        silent.report(TransferResult(first, True, 1, 0.0))
        silent.report(TransferResult(second, True, 1, 0.0))
    for waiter in waiters:
        waiter.join(15)
    assert got == {first: first, second: second}


def test_result_of_a_hung_job_times_out():
    plane, _ = plane_with(Silent())
    job = gpu_to_cpu(plane)
    with pytest.raises(TimeoutError, match=f"job {job}"):
        plane.result(job, timeout=0.2)


def test_wait_finished_wakes_on_a_report_from_another_thread():
    router = TransferRouter()
    assert not router.has_finished() and router.wait_finished(timeout=0.05) is False
    handler = Gated()
    router.register(GPULoadStoreSpec, CPULoadStoreSpec, handler)
    router.submit(GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    threading.Timer(0.1, handler.gate.set).start()
    assert router.wait_finished(timeout=30) and router.has_finished()
    (result,) = router.poll()
    assert result.success and not router.has_finished()
    router.shutdown()


def test_hierarchy_routes_kv_jobs_on_the_worker_plane_only():
    """The manager's router never sees a KV-cache job, so its polling (lookup, step, wait_idle)
    cannot take the worker's results; the worker plane runs no tier-to-tier job."""
    kv = make_kv()
    with build_hierarchy(load_config_text(TWO_MEMORY_TIERS), kv_caches=kv) as h:
        assert h.router.handler_for(GPULoadStoreSpec, CPULoadStoreSpec) is None
        assert h.router.handler_for(CPULoadStoreSpec, CPULoadStoreSpec) is not None
        assert h.worker.handler_for(CPULoadStoreSpec, CPULoadStoreSpec) is None
        (key,) = keys(1)
        out = h.manager.prepare_store([key])
        job = h.worker.submit(GPULoadStoreSpec([5]), out.store_spec)
        h.manager.lookup(key)
        h.manager.on_schedule_end()
        h.manager.wait_idle()
        (result,) = h.worker.poll()
        assert result.job_id == job and result.success
        h.manager.complete_store([key], success=True)
        slot = out.store_spec.block_ids[0]
        assert bytes(h.backends["hot"].view(slot)[:PAGE]) == kv.tensors[0].tensor[5].numpy().tobytes()


def test_without_kv_caches_the_worker_plane_is_empty():
    with build_hierarchy(load_config_text(TWO_MEMORY_TIERS)) as h:
        job = h.worker.submit(GPULoadStoreSpec([0]), CPULoadStoreSpec([0], tier="hot"))
        result = h.worker.result(job, timeout=5)
        assert not result.success and "no handler" in result.error


def test_a_failed_build_stops_the_handlers_it_made(monkeypatch):
    """A handler factory that raises after others made handlers (thread pools): those are shut
    down and the tiers closed, nothing keeps running after the error."""
    made: list[ThreadedHandler] = []
    closed: list[str] = []

    def good(backends, kv_caches):
        made.append(Gated())
        return made[-1]

    def bad(backends, kv_caches):
        raise RuntimeError("injected factory failure")

    from kvtier.core.specs import CPULoadStoreSpec, GPULoadStoreSpec

    injected = {(CPULoadStoreSpec, CPULoadStoreSpec): good, (GPULoadStoreSpec, CPULoadStoreSpec): bad}
    handler_factory = registry.handler_factory
    monkeypatch.setattr(registry, "handler_factory",
                        lambda src, dst: injected.get((src, dst)) or handler_factory(src, dst))
    from kvtier.tiers.memory import MemoryBackend

    original_close = MemoryBackend.close
    monkeypatch.setattr(MemoryBackend, "close", lambda self: (closed.append(self.name), original_close(self)))
    with pytest.raises(RuntimeError, match="injected factory failure"):
        build_hierarchy(load_config_text(TWO_MEMORY_TIERS), kv_caches=make_kv())
    assert len(made) == 1 and made[0].stopped
    assert sorted(closed) == ["hot", "warm"]
