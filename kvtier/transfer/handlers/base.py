"""`TransferHandler`: moves bytes for one (source spec type, destination spec type) pair.

Handlers are asynchronous: `submit` starts a job and returns; completion is reported with
`report(result)` (the `on_done` callback the router binds), from any thread. Exceptions raised by
`submit` (or inside a worker thread) become a failed `TransferResult` for that job only.
`CompletionQueue` is where reports land: the router binds its `put` and collects from it.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvtier.core.errors import BlocksFailed
from kvtier.core.specs import LoadStoreSpec
from kvtier.core.types import TransferResult

log = logging.getLogger(__name__)

DoneCallback = Callable[[TransferResult], None]


def serving(backends: Mapping[str, Any], capability: type) -> dict[str, Any]:
    """The backends (by name) that offer `capability`, a runtime-checkable Protocol of
    `kvtier.tiers.base` (`HostSlots`, `HostRegion`, `BlockFile`). Handler factories call this
    once, when they build a handler; a handler never inspects a backend afterwards."""
    return {name: b for name, b in backends.items() if isinstance(b, capability)}


def pick_backend(backends: Mapping[str, Any], spec: Any, what: str) -> Any:
    """The backend of `backends` that `spec.tier` names; a spec that names no tier (vLLM's own
    specs) means the only one. Raises ValueError naming the backends there are."""
    tier = getattr(spec, "tier", None)
    if tier is None:
        if len(backends) == 1:
            return next(iter(backends.values()))
        raise ValueError(f"the {type(spec).__name__} names no tier and there are {len(backends)} {what} "
                         f"backends ({', '.join(backends)})")
    try:
        return backends[tier]
    except KeyError:
        raise ValueError(f"no {what} backend named {tier!r} (have {', '.join(backends)})") from None


def host_pair(hosts: Mapping[str, Any], others: Mapping[str, Any], host_spec: Any, other_spec: Any,
              other_kind: str) -> tuple[Any, Any]:
    """The host-memory backend and the `other_kind` backend (file, remote) that two specs of one
    job name, checked to move the same number of blocks of one size. Raises ValueError."""
    if len(host_spec) != len(other_spec):
        raise ValueError(f"source has {len(host_spec)} blocks, destination {len(other_spec)}")
    host = pick_backend(hosts, host_spec, "host-memory")
    other = pick_backend(others, other_spec, other_kind)
    if host.block_bytes != other.block_bytes:
        raise ValueError(f"block size differs: {host.name}={host.block_bytes} B, {other.name}={other.block_bytes} B")
    return host, other


def failed_result(job_id: int, start: float, exc: BaseException) -> TransferResult:
    """The failed result of job `job_id`, started at `start` (`time.perf_counter()`), naming `exc`;
    a `BlocksFailed` names its blocks (the others were delivered: its `moved` bytes)."""
    if isinstance(exc, BlocksFailed):
        failed, moved = exc.positions, exc.moved
    else:
        failed, moved = (), 0
    return TransferResult(job_id, False, moved, time.perf_counter() - start,
                          error=f"{type(exc).__name__}: {exc}", failed_blocks=failed)


def run_copy(job_id: int, copy: Callable[[LoadStoreSpec, LoadStoreSpec], int], src: LoadStoreSpec,
             dst: LoadStoreSpec) -> TransferResult:
    """Run one job's copy and time it; an exception becomes a failed result for this job only
    (`BlocksFailed`: for the blocks it names only)."""
    start = time.perf_counter()
    try:
        moved = copy(src, dst)
    except Exception as exc:  # noqa: BLE001 - any failure fails this job only
        return failed_result(job_id, start, exc)
    return TransferResult(job_id, True, moved, time.perf_counter() - start)


class TransferHandler(ABC):
    """Moves bytes for one hop. Subclasses implement `submit`; `wait` blocks until jobs finish."""

    def __init__(self) -> None:
        self._on_done: DoneCallback = lambda result: None

    def bind(self, on_done: DoneCallback) -> None:
        """Called once by the router: `on_done(result)` must be called once per submitted job."""
        self._on_done = on_done

    def report(self, result: TransferResult) -> None:
        """Report one finished job to the router (the `on_done` given to `bind`): exactly once per
        submitted job, from any thread. A handler calls it; the router reads it."""
        self._on_done(result)

    @abstractmethod
    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        """Start copying the blocks of `src` into `dst` (same length, same order)."""

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs have been reported. Synchronous handlers have nothing to do."""
        return

    def shutdown(self) -> None:
        return


class SyncHandler(TransferHandler, ABC):
    """A handler whose copy runs to completion inside `submit` (memory copies)."""

    @abstractmethod
    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        """Copy all blocks; return the number of bytes moved. Raise on failure."""

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self.report(run_copy(job_id, self.copy, src, dst))


class ThreadedHandler(TransferHandler, ABC):
    """A handler whose copies run on a private thread pool (file I/O)."""

    def __init__(self, num_threads: int = 4, thread_name: str = "kvtier-io") -> None:
        super().__init__()
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=thread_name)
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()

    @abstractmethod
    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        """Runs on a pool thread: copy all blocks, return bytes moved, raise on failure."""

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        with self._lock:  # held across submit: a job that finishes at once must find its future
            self._futures[job_id] = self._pool.submit(self._run, job_id, src, dst)

    def _run(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        result = run_copy(job_id, self.copy, src, dst)
        self.report(result)  # before forgetting the future, so wait() implies reported
        with self._lock:
            self._futures.pop(job_id, None)

    def wait(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            futures = [self._futures[j] for j in job_ids if j in self._futures]
        for future in futures:
            future.exception()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class ImmediateHandler(TransferHandler):
    """Completes every job at once without moving bytes (trace replay: only the control plane)."""

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self.report(TransferResult(job_id, True, 0, 0.0))


class CompletionQueue:
    """The reports of running jobs, between the handlers (`put`, bound as their `on_done`, from
    any thread) and the router that collects them (`finished`, single-threaded). `running` maps
    each job started (`start`) and not reported yet to what it copies; `reported` guards both and
    is notified with each report. Reentrant: a handler that finishes inside `submit` reports on
    the submitting thread, which may hold it (`WorkerPlane`)."""

    def __init__(self) -> None:
        self.finished: deque[TransferResult] = deque()
        self.reported = threading.Condition(threading.RLock())
        self.running: dict[int, tuple[TransferHandler, LoadStoreSpec, LoadStoreSpec]] = {}

    def start(self, job_id: int, handler: TransferHandler, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        """Job `job_id` is about to be submitted to `handler` (running until its report)."""
        with self.reported:
            self.running[job_id] = (handler, src, dst)

    def put(self, result: TransferResult) -> None:
        """A job's report (any thread): queue it, the job is no longer running; wake waiters."""
        with self.reported:
            self.running.pop(result.job_id, None)
            self.finished.append(result)
            self.reported.notify_all()

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Block until some report is queued (at most `timeout` seconds; None: no limit); whether one is."""
        with self.reported:
            return self.reported.wait_for(lambda: bool(self.finished), timeout)

    def wait_running(self, timeout: float | None = None) -> dict[int, tuple[TransferHandler, LoadStoreSpec,
                                                                             LoadStoreSpec]]:
        """Block until no job is running (at most `timeout` seconds; None: no limit); the jobs
        still running then (a copy of `running`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.reported:
            while self.running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self.reported.wait(left)
            return dict(self.running)
