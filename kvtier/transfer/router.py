"""The router: maps a (source spec type, destination spec type) pair to its handler and tracks jobs.

`submit` never blocks on I/O; finished jobs are collected with `poll` (or waited for with
`wait_finished`, which sleeps until a handler reports). A `CompositeLoadStoreSpec` source is split
into one sub-job per part, and its job reports success only if every part did (a failed one
names the blocks of the failed parts, or those the parts named).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.core.specs import CompositeLoadStoreSpec, LoadStoreSpec, PartsLoadStoreSpec
from kvtier.core.types import TransferResult
from kvtier.transfer.handlers.base import CompletionQueue, TransferHandler

log = logging.getLogger(__name__)

SpecPair = tuple[type[LoadStoreSpec], type[LoadStoreSpec]]


def spec_tiers(spec: LoadStoreSpec) -> set[str]:
    """The names of the tiers a spec addresses (the parts' of a multi-part spec; none for the KV caches)."""
    if isinstance(spec, PartsLoadStoreSpec):
        return set().union(*(spec_tiers(part) for part, _ in spec.parts))
    tier = getattr(spec, "tier", None)
    return {tier} if tier else set()


@dataclass
class Abandoned:
    """The jobs a bounded `shutdown` left running (one line each) and the tiers they use: their
    handlers were not stopped and those tiers' backends must stay open (a copy may still touch them)."""

    jobs: list[str] = field(default_factory=list)
    tiers: set[str] = field(default_factory=set)


class _Composite:
    """A composite job being run as one sub-job per part; `failed`: its positions that failed."""

    __slots__ = ("job_id", "remaining", "success", "size", "seconds", "failed")

    def __init__(self, job_id: int, parts: int):
        self.job_id, self.remaining, self.success, self.size, self.seconds = job_id, parts, True, 0, 0.0
        self.failed: list[int] = []

    def add(self, result: TransferResult, positions: list[int]) -> TransferResult | None:
        """Account for one part's `result` (the part addressed the job's `positions`); the job's
        result once every part reported (failed when a part did, naming the blocks that failed)."""
        self.remaining -= 1
        self.success &= result.success
        self.size += result.transfer_size or 0
        self.seconds = max(self.seconds, result.transfer_time or 0.0)
        self.failed += [positions[p] for p in result.failed_positions(len(positions))]
        if self.remaining:
            return None
        if self.success:
            return TransferResult(self.job_id, True, self.size, self.seconds)
        return TransferResult(self.job_id, False, self.size, self.seconds, error="a part of the job failed",
                              failed_blocks=tuple(sorted(self.failed)))


class TransferRouter:
    """Routes jobs to handlers; thread-safe completion, single-threaded submission and polling
    (`WorkerPlane` serialises them under `reported`)."""

    def __init__(self) -> None:
        self._handlers: dict[SpecPair, TransferHandler] = {}
        # The handlers report into `_completions` (its `put` is their `on_done`), from any thread.
        self._completions = completions = CompletionQueue()
        self.finished = completions.finished  # the reports `poll` has not collected yet
        self.reported = completions.reported  # notified with each report (reentrant)
        self._ids = itertools.count(1 << 40)  # far from ids chosen by callers (vLLM job ids)
        self._parents: dict[int, tuple[_Composite, list[int]]] = {}  # sub-job -> (its job, the positions it addresses)
        self._pending: dict[int, TransferHandler] = {}
        self.failed_jobs: dict[str, int] = {}  # kind of error (its exception type) -> jobs failed with it

    def register(self, src_type: type[LoadStoreSpec], dst_type: type[LoadStoreSpec], handler: TransferHandler) -> None:
        """Serve jobs from `src_type` to `dst_type` with `handler` (replaces an earlier one)."""
        self._handlers[(src_type, dst_type)] = handler
        handler.bind(self._completions.put)

    def handler_for(self, src_type: type[LoadStoreSpec], dst_type: type[LoadStoreSpec]) -> TransferHandler | None:
        """The handler of a pair, also matching registered base classes of the spec types."""
        handler = self._handlers.get((src_type, dst_type))
        if handler is None:
            for s, d in itertools.product(src_type.__mro__, dst_type.__mro__):
                handler = self._handlers.get((s, d))
                if handler is not None:
                    break
        return handler

    def new_job_id(self) -> int:
        return next(self._ids)

    def submit(self, src: LoadStoreSpec, dst: LoadStoreSpec, job_id: int | None = None) -> int:
        """Start a job; returns its id. A missing handler or a raising handler fails the job (see `poll`)."""
        if job_id is None:
            job_id = self.new_job_id()
        if isinstance(src, CompositeLoadStoreSpec):
            try:
                parts = [(spec, dst.subset(positions)) for spec, positions in src.parts]
            except (TypeError, AttributeError, IndexError) as exc:
                self._fail(job_id, f"cannot split the destination of a multi-tier job: {exc}")
                return job_id
            parent = _Composite(job_id, len(parts))
            for (spec, sub_dst), (_, positions) in zip(parts, src.parts):
                sub_id = self.new_job_id()
                self._parents[sub_id] = (parent, positions)
                self._submit_one(sub_id, spec, sub_dst)
        else:
            self._submit_one(job_id, src, dst)
        return job_id

    def _submit_one(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        handler = self.handler_for(type(src), type(dst))
        if handler is None:
            self._fail(job_id, f"no handler registered for {type(src).__name__} -> {type(dst).__name__}")
            return
        self._pending[job_id] = handler
        self._completions.start(job_id, handler, src, dst)
        try:
            handler.submit(job_id, src, dst)
        except Exception as exc:  # noqa: BLE001 - a handler failure fails this job only
            self._fail(job_id, f"{type(exc).__name__}: {exc}")

    def _fail(self, job_id: int, error: str) -> None:
        self._completions.put(TransferResult(job_id, False, 0, 0.0, error=error))

    def has_finished(self) -> bool:
        """Whether some result is waiting to be collected by `poll` (a part of a composite job too)."""
        return bool(self.finished)

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Block until some result is waiting for `poll` (at most `timeout` seconds; None: no limit).
        Returns whether one is. Sleeps on a condition the handlers' reports signal: no polling."""
        return self._completions.wait_finished(timeout)

    def _note_failure(self, result: TransferResult) -> None:
        """Count a failed job by the kind of its error; the first of each kind is a WARNING, later
        ones DEBUG (a server that keeps failing fails every job: the tiers' stats count them)."""
        kind = (result.error or "").partition(":")[0] or "unknown"
        seen = self.failed_jobs.get(kind, 0)
        self.failed_jobs[kind] = seen + 1
        log.log(logging.DEBUG if seen else logging.WARNING, "transfer job %d failed: %s%s", result.job_id,
                result.error, "" if seen else f" (later failures of {kind} are logged at DEBUG only)")

    def poll(self) -> list[TransferResult]:
        """Results of the jobs that finished since the last call (composite jobs once, when whole)."""
        done = self.finished
        if not done:
            return []
        results: list[TransferResult] = []
        while done:
            result = done.popleft()
            self._pending.pop(result.job_id, None)
            if not result.success:
                self._note_failure(result)
            part = self._parents.pop(result.job_id, None)
            if part is None:
                results.append(result)
                continue
            whole = part[0].add(result, part[1])
            if whole is not None:
                results.append(whole)
        return results

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Block until the given jobs (default: all submitted) have finished; results stay for `poll`."""
        pending, parents = dict(self._pending), dict(self._parents)  # (copies: `poll` may run meanwhile)
        wanted = set(pending) if job_ids is None else set(job_ids)
        wanted |= {sub for sub, (parent, _) in parents.items() if parent.job_id in wanted}
        by_handler: dict[int, tuple[TransferHandler, list[int]]] = {}
        for job_id in wanted:
            handler = pending.get(job_id)
            if handler is not None:
                by_handler.setdefault(id(handler), (handler, []))[1].append(job_id)
        for handler, ids in by_handler.values():
            handler.wait(ids)

    def has_pending(self) -> bool:
        """Jobs submitted and not yet collected by `poll`."""
        return bool(self._pending) or bool(self.finished)

    def shutdown(self, timeout: float | None = None) -> Abandoned:
        """Stop the handlers once their running jobs have reported, waiting at most `timeout`
        seconds (None: as long as it takes). The jobs still running then are abandoned (returned,
        and logged by the caller): their handlers are left running, so a hung read or write
        cannot hold the shutdown; the other handlers are stopped."""
        running = self._completions.wait_running(timeout)
        busy = {id(handler) for handler, _, _ in running.values()}
        for handler in {id(h): h for h in self._handlers.values()}.values():
            if id(handler) not in busy:
                handler.shutdown()
        left_running = Abandoned()
        for job_id, (handler, src, dst) in running.items():
            left_running.jobs.append(f"job {job_id}: {type(src).__name__} -> {type(dst).__name__} "
                                     f"on {type(handler).__name__}")
            left_running.tiers |= spec_tiers(src) | spec_tiers(dst)
        return left_running
