"""Jobs the manager starts (copies between two tiers), the table of running ones, the event log.

A `Job` knows its tiers, its keys and the slot ids of both sides: `pin_sources` pins the source
blocks (`CachePolicy.pin_loads`) and `enter_copies` allocates and inserts the copies being written
(`CachePolicy.insert_written`). When the router reports the job, `finish(result)` releases the
source pins (`release_loads`), settles the destination blocks (`mark_written`, or removed and
freed on failure) and the byte counters, then lets the job type do its own bookkeeping (`landed`
/ `failed`). No block object is kept: every policy answers these batch calls (`CachePolicy` has
defaults for the pure-Python ones).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvtier.control.tier import WRITING, Tier
from kvtier.keys import OffloadKey
from kvtier.router import TransferRouter
from kvtier.types import BlockStatus, OffloadingEvent, TransferResult

if TYPE_CHECKING:
    from kvtier.control.context import ControlContext


def pin_sources(tier: Tier, keys: list[OffloadKey]) -> list[int]:
    """Pin readable blocks `keys` of `tier` for a copy (`CachePolicy.pin_loads`: `ref_cnt += 1`
    and `pin`); their slot ids. The caller checked that every key is readable."""
    ids = tier.table.pin_loads(keys)
    if ids is None:
        raise KeyError(f"tier {tier.name}: a block to copy is not readable")
    return ids


def enter_copies(tier: Tier, keys: list[OffloadKey], tail_first: bool = False) -> list[int]:
    """Allocate slots of `tier` for `keys` (distinct, absent there; the caller made room), in
    their order, and insert them being written (`ref_cnt == -1`, pinned) through the policy's
    `insert_written`; their slot ids. With `tail_first` (a request's new blocks) they are
    inserted last key first, the last one named as the request's tail (the
    `CachePolicy.insert_many` contract); copies have no tail.

    Atomic under a policy error: when inserting or pinning raises (a third-party policy refusing
    a key), the keys already inserted are removed, the slots freed, and the error propagates."""
    step, tail = (-1, keys[-1] if keys else None) if tail_first else (1, None)
    ids = tier.backend.allocate_block_ids(keys)
    try:
        tier.table.insert_written(keys[::step], ids[::step], tail=tail)
    except BaseException:
        # (the keys a failed insert left resident leave as a failed write does, slots freed)
        removed = set(tier.remove(keys, WRITING, ids))
        tier.backend.free_block_ids([i for k, i in zip(keys, ids) if k not in removed])
        raise
    return ids


class EventLog:
    """Block-stored / block-removed events for `take_events` (a no-op when events are off)."""

    def __init__(self, enabled: bool):
        self.events: list[OffloadingEvent] | None = [] if enabled else None

    def record(self, tier: Tier, keys: list[OffloadKey], removed: bool) -> None:
        if keys and self.events is not None:
            self.events.append(OffloadingEvent(list(keys), tier.backend.block_size, tier.medium, removed, tier.name))

    def take(self) -> list[OffloadingEvent]:
        if not self.events:
            return []
        events, self.events = self.events, []
        return events


class Job:
    """A copy of `keys` (distinct) from `src` (slots `src_ids`, pinned meanwhile) into new blocks
    of `dst` (slots `dst_ids`, being written); its events go to the context's log."""

    kind = "copy"

    def __init__(self, ctx: ControlContext, src: Tier, dst: Tier, keys: list[OffloadKey], src_ids: list[int],
                 dst_ids: list[int]):
        self.src, self.dst, self.keys = src, dst, keys
        self.src_ids, self.dst_ids = src_ids, dst_ids
        self.events = ctx.events

    def source_blocks(self) -> list[BlockStatus]:
        """`BlockStatus`es of the source slot ids (their `block_id` is all they tell: for
        `Backend.still_valid` and comparisons)."""
        return BlockStatus.many(self.src_ids)

    def finish(self, result: TransferResult) -> None:
        """Account for the router's report of this job (called once)."""
        src, dst = self.src, self.dst
        src.table.release_loads(self.keys)  # (pinned by this job: resident)
        if result.success:
            if not dst.table.mark_written(self.keys):  # (some block not being written any more)
                get = dst.policy.get
                for key, block_id in zip(self.keys, self.dst_ids):
                    view = get(key)
                    if view is not None and view.block_id == block_id:
                        view.ref_cnt = 0
                dst.policy.unpin(self.keys)
            src.stats.bytes_out += result.transfer_size or 0
            src.stats.seconds_out += result.transfer_time or 0.0
            dst.stats.bytes_in += result.transfer_size or 0
            dst.stats.seconds_in += result.transfer_time or 0.0
            dst.stats.stores += len(self.keys)
            self.events.record(dst, self.keys, removed=False)
            self.landed()
        else:
            src.stats.failures += 1
            dst.stats.failures += 1
            dst.remove(self.keys, WRITING, self.dst_ids)
            self.failed()

    def landed(self) -> None:
        """Bookkeeping of the job type after its blocks became readable in `dst`."""

    def failed(self) -> None:
        """Bookkeeping of the job type after the copy failed and its `dst` blocks were removed."""

    def __str__(self) -> str:
        return f"{self.kind} of {len(self.keys)} blocks {self.src.name} -> {self.dst.name}"


class JobTable:
    """The jobs the manager submitted to the router and has not yet accounted for, by job id."""

    def __init__(self, router: TransferRouter):
        self._router = router
        self._jobs: dict[int, Job] = {}

    def submit(self, job: Job) -> None:
        src_spec = job.src.backend.spec_for_ids(job.keys, job.src_ids)
        dst_spec = job.dst.backend.spec_for_ids(job.keys, job.dst_ids)
        job_id = self._router.new_job_id()
        self._jobs[job_id] = job
        self._router.submit(src_spec, dst_spec, job_id)

    def drain(self) -> None:
        """Account for every job the router reported since the last call."""
        for result in self._router.poll():
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                job.finish(result)

    def results_waiting(self) -> bool:
        """Whether the router holds reports not drained yet (cheap)."""
        return self._router.has_finished()

    def wait(self, deadline: float | None) -> bool:
        """Block until a running job reports (all of them when `deadline` is None); False when
        `deadline` (a `time.monotonic()` value) passed first. A bounded wait polls the router
        instead of blocking in a handler, so a hung handler cannot hold it."""
        if deadline is None:
            self._router.wait(list(self._jobs))
            return True
        pause = 0.0005
        while not self._router.has_finished():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.01)
        return True

    def describe(self) -> list[str]:
        """One line per running job (for errors and logs)."""
        return [f"job {job_id}: {job}" for job_id, job in self._jobs.items()]

    def tiers(self) -> set[str]:
        """Names of the tiers that running jobs read or write."""
        return {t.name for job in self._jobs.values() for t in (job.src, job.dst)}

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[int]:
        return iter(self._jobs)
