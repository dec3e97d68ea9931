"""No CUDA object outlives its job in a handler thread's thread-local state.

A fork clears the other threads' states in the child (`PyOS_AfterFork_Child`); a CUDA event
destroyed there aborts the child ("CUDA error: initialization error"). On CPU, a stand-in event
whose destruction in a forked child exits with 134 (like that abort) shows the same thing.
"""

from __future__ import annotations

import os
import weakref

import pytest

from kvtier import CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from kvtier.transfer.handlers.gpu_cpu import EngineJobHandler
from kvtier.transfer.handlers.kv_layout import KVLayout

torch = pytest.importorskip("torch")


class FakeEvent:
    """Stands for the job's `torch.cuda.Event`: destroying it in a forked child aborts the child."""

    def __init__(self):
        self.pid = os.getpid()

    def __del__(self):
        if os.getpid() != self.pid:
            os._exit(134)


class Recording(EngineJobHandler):
    """An engine job handler whose jobs only look at their ready event, a `FakeEvent` per job
    (made where `submit` records the CUDA event); `events` holds weak references to them."""

    def __init__(self):
        kv = CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros((4, 64), dtype=torch.uint8), 64)], None)
        super().__init__(KVLayout(kv), 2, "kvtier-test")
        self.saw_event = False
        self.events: list[weakref.ref] = []

    def record_ready(self) -> FakeEvent:
        event = FakeEvent()
        self.events.append(weakref.ref(event))
        return event

    def copy(self, src, dst) -> int:
        self.saw_event = isinstance(self.ready_event(), FakeEvent)
        return 0


def run_job_with_event(handler: Recording, job_id: int) -> weakref.ref:
    """Run one job; its compute-stream event is a `FakeEvent` (as `submit` records on CUDA)."""
    spec = GPULoadStoreSpec([0])
    handler.submit(job_id, spec, spec)
    handler.wait([job_id])
    return handler.events[-1]


def test_the_ready_event_is_released_when_its_job_ends():
    handler, results = Recording(), []
    handler.bind(results.append)
    try:
        ref = run_job_with_event(handler, 7)
        assert handler.saw_event and [r.success for r in results] == [True]
        assert ref() is None, "the job's event is still held (thread-local state of the handler thread)"
        assert handler.ready_event() is None
    finally:
        handler.shutdown()


def test_a_child_forked_while_handler_threads_live_exits_cleanly():
    handler = Recording()
    handler.bind(lambda result: None)
    try:
        for job_id in range(4):  # both pool threads ran a job with an event
            run_job_with_event(handler, job_id)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        handler.shutdown()
