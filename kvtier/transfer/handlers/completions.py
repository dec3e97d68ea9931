"""Completion of device jobs that were submitted on the caller's thread.

A handler that plans and submits a job's copies itself, in `submit`, hands the job's end event to
`Completions`: one thread waits for each event in submission order (the jobs of one stream end
in that order) and passes the job's result to the handler's `finish` callback. Waiting releases
the GIL, and the thread's own Python work per job is a few lines, so it does not hold up the
submitting thread (two threads that both plan jobs convoy on the GIL: docs/benchmarks.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.core.types import TransferResult
from kvtier.transfer.handlers.base import failed_result

_STOP = None


class Completions:
    """Waits for submitted jobs' end events on one thread (started at the first job) and
    reports each through `finish(result)`: success with the job's byte count, or a failed result
    naming the error `synchronize()` raised. `close()` waits for every job added before it."""

    def __init__(self, thread_name: str, finish: Callable[[TransferResult], None]):
        self._finish = finish
        self._name = thread_name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, job_id: int, done: Any, nbytes: int, start: float) -> None:
        """Report job `job_id` once `done` (an event recorded after its copies) has fired;
        `start` is its `time.perf_counter()` at submission."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((job_id, done, nbytes, start))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job_id, done, nbytes, start = item
            del item  # (no CUDA object stays referenced here once its job is reported)
            try:
                done.synchronize()
            except Exception as exc:  # noqa: BLE001 - an asynchronous copy error fails this job only
                result = failed_result(job_id, start, exc)
            else:
                result = TransferResult(job_id, True, nbytes, time.perf_counter() - start)
            done = None
            self._finish(result)

    def close(self) -> None:
        """Report every job added so far, then stop the thread. Idempotent."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            thread.join()
