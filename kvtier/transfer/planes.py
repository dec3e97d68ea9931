"""The two planes' routers, built from the registry: tier-to-tier jobs and KV-cache jobs.

A hierarchy moves bytes on two planes that never share a router:

* the **control plane**'s router (`build_router(kv_side=False)`) runs the manager's jobs between
  tiers (cascade, promotion); the manager collects their results on its own calls.
* the **worker plane** (`build_worker_plane`) runs the jobs that touch the engine's KV caches
  (`GPULoadStoreSpec` on one side): stores into the first tier and loads out of any tier a handler
  reads directly. Its caller (the standalone `KVTier`, or vLLM's worker process) collects them.

Keeping the routers apart means neither side can swallow the other's results, and the worker
plane can live in another process (vLLM) over the same backends (the shared CPU region).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from kvtier.core.specs import GPULoadStoreSpec, LoadStoreSpec
from kvtier.core.types import TransferResult
from kvtier.tiers.base import Backend
from kvtier.transfer import registry
from kvtier.transfer.handlers.base import ImmediateHandler, TransferHandler
from kvtier.transfer.router import Abandoned, TransferRouter


def _touches_kv(src: type, dst: type) -> bool:
    """Whether a pair of spec types has the engine's KV caches (`GPULoadStoreSpec`) on one side."""
    return issubclass(src, GPULoadStoreSpec) or issubclass(dst, GPULoadStoreSpec)


def build_router(backends: Mapping[str, Backend], kv_caches: Any = None, *, kv_side: bool,
                 dry_run: bool = False) -> TransferRouter:
    """A `TransferRouter` with a handler for every registered pair both of whose spec types are
    present (a backend's `spec_type`, or the KV caches' `GPULoadStoreSpec` when `kv_caches` is
    given) and that the factory can serve. `kv_side` selects the pairs with a KV-cache side (the
    worker plane), else the pairs without (the control plane). With `dry_run` every handler
    completes at once without bytes. A factory that raises stops the handlers made before it."""
    for backend_cls in dict.fromkeys(type(b) for b in backends.values()):
        registry.enter_kind(backend_cls)  # (a backend built without the registry brings its hops here)
    present = [b.spec_type for b in backends.values()]
    if kv_caches is not None:
        present.append(GPULoadStoreSpec)
    router = TransferRouter()
    try:
        for src, dst in registry.handler_pairs(present):
            if _touches_kv(src, dst) != kv_side:
                continue
            handler = ImmediateHandler() if dry_run else registry.handler_factory(src, dst)(backends, kv_caches)
            if handler is not None:
                router.register(src, dst, handler)
    except BaseException:
        router.shutdown()
        raise
    return router


class WorkerPlane:
    """The jobs that copy between the engine's KV caches and the tiers, and their results.

    A `TransferRouter` over the KV-side handlers (see `build_worker_plane`). Jobs are collected
    either as they finish (`poll`, as vLLM's worker does) or one by one (`result`, which sleeps
    until the job's handler reports it). Thread-safe: `submit`, `poll` and `result` may be called
    from several threads, and a thread waiting in `result` is woken when another thread collects
    its job's report (it is kept for it). The plane owns its handlers (`shutdown` stops them),
    never the backends: whoever built those closes them, after the plane.
    """

    def __init__(self, router: TransferRouter):
        self._router = router
        self._unclaimed: dict[int, TransferResult] = {}  # collected from the router, not yet returned
        # The router's report condition also guards `_unclaimed` and the router's submission and
        # polling: a waiter sleeps on it until a handler reports or another thread collected.
        self._cond = router.reported

    def handler_for(self, src_type: type[LoadStoreSpec], dst_type: type[LoadStoreSpec]) -> TransferHandler | None:
        """The handler serving `src_type -> dst_type` here, or None."""
        return self._router.handler_for(src_type, dst_type)

    def loads_from(self, spec_type: type[LoadStoreSpec]) -> bool:
        """Whether a handler here copies blocks addressed by `spec_type` straight into the KV caches."""
        return self._router.handler_for(spec_type, GPULoadStoreSpec) is not None

    def submit(self, src: LoadStoreSpec, dst: LoadStoreSpec, job_id: int | None = None) -> int:
        """Start a job (`TransferRouter.submit`); returns its id. Never blocks on the copy."""
        with self._cond:
            return self._router.submit(src, dst, job_id)

    def poll(self) -> list[TransferResult]:
        """Results of the jobs finished since the last call (and not returned by `result`)."""
        with self._cond:
            results = list(self._unclaimed.values())
            self._unclaimed.clear()
            return results + self._router.poll()

    def result(self, job_id: int, timeout: float | None = None) -> TransferResult:
        """Wait for the result of job `job_id` (submitted here) and return it; results of other
        jobs finishing meanwhile stay for `poll` (or their own `result` call, which is woken).
        `TimeoutError` after `timeout` seconds (None: no limit), the job still running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if job_id not in self._unclaimed:
                    collected = self._router.poll()
                    if collected:
                        self._unclaimed.update((r.job_id, r) for r in collected)
                        self._cond.notify_all()  # (another thread may wait for one of them)
                if job_id in self._unclaimed:
                    return self._unclaimed.pop(job_id)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"transfer job {job_id} did not finish within {timeout} s")
                self._cond.wait(left)

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Block until the given jobs (default: all submitted) have finished; results stay for `poll`.
        (Not under the condition: the handlers' reports need it.)"""
        self._router.wait(job_ids)

    def shutdown(self, timeout: float | None = None) -> Abandoned:
        """Stop the handlers once their running copies finish, at most `timeout` seconds (None: no
        limit); the copies still running then are abandoned and returned
        (`TransferRouter.shutdown`). The backends stay open."""
        return self._router.shutdown(timeout)


def build_worker_plane(backends: Mapping[str, Backend], kv_caches: Any, *, dry_run: bool = False) -> WorkerPlane:
    """The worker plane over `kv_caches` (`CanonicalKVCaches`; a `ChunkedKVCaches` when one block
    spans several engine blocks) and `backends` (name -> backend, e.g. every tier of a hierarchy,
    or the one CPU region a vLLM worker attached): a handler for each registered pair between the
    KV caches and a backend kind present. Without `kv_caches` the plane serves nothing."""
    return WorkerPlane(build_router(backends, kv_caches, kv_side=True, dry_run=dry_run))
