"""Jobs the manager starts (copies between two tiers), the table of running ones, the event log.

A `Job` knows its tiers, its keys and the slot ids of both sides: `pin_sources` pins the source
blocks (`BlockTable.pin_loads`); the destination tier took the copies being written
(`kvtier.control.tier.enter_copies`). When the router reports the job, `finish(result)` releases the
source pins (`Tier.release_loads`), makes the blocks the job delivered readable (`mark_written`)
and removes those that failed (one outcome: `TransferResult.failed_positions`, counted once, a
block that failed its read condemned in the tier it came from) and those the destination did not
take although the job succeeded (`not_taken`: a shared tier's unsent writes; never reported
stored), then lets the job type do its own bookkeeping (`landed`, `failed`, `ended`). No block
object is kept: jobs work on keys and slot ids through the tier's `BlockTable`. `Demotion`, the
cascade's copy down, is here: the cascade drains the table while it decides, and the jobs it
finishes then must not call back into it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvtier.control.tier import WRITING, Tier
from kvtier.core.keys import OffloadKey
from kvtier.core.types import OffloadingEvent, TransferResult
from kvtier.transfer.router import TransferRouter

if TYPE_CHECKING:
    from kvtier.control.context import ControlContext


def pin_sources(tier: Tier, keys: list[OffloadKey]) -> list[int]:
    """Pin readable blocks `keys` of `tier` for a copy (`BlockTable.pin_loads`: `ref_cnt += 1`
    and `pin`); their slot ids. The caller checked that every key is readable."""
    ids = tier.table.pin_loads(keys)
    if ids is None:
        raise KeyError(f"tier {tier.name}: a block to copy is not readable")
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

    reads_fail = False  # a failed block is the source's (a read that did not verify), else the destination's

    def finish(self, result: TransferResult) -> None:
        """Account for the router's report of this job (called once). The blocks it delivered
        become readable in `dst` (counted in `stores`, one `stored` event); those that failed
        (`TransferResult.failed_positions`) are removed there and counted once, in `src` when the
        job read them (`reads_fail`: they are condemned there, never served again) or else in `dst`;
        those the job reported delivered but `dst` did not take after all (`not_taken`) are removed
        there without an event: `dst` never held them, so no event says it did."""
        src, dst, keys = self.src, self.dst, self.keys
        failed_at = result.failed_positions(len(keys))
        bad = [keys[p] for p in failed_at]
        if bad and self.reads_fail:
            src.condemn(bad)  # (before the pins go: the blocks this job read)
        elif bad:
            dst.stats.failures += len(bad)
        self.events.record(src, src.release_loads(keys), removed=True)
        failed = set(failed_at)
        delivered = [k for p, k in enumerate(keys) if p not in failed] if failed else keys
        if delivered:  # (asked before any becomes readable: a block not taken is never reported stored)
            not_taken = self.not_taken(delivered)
            if not_taken:
                unsent = set(not_taken)
                failed.update(p for p, k in enumerate(keys) if k in unsent)
        if failed:
            gone = sorted(failed)
            dst.remove([keys[p] for p in gone], WRITING, [self.dst_ids[p] for p in gone])
            good = [p for p in range(len(keys)) if p not in failed]
            self._settle([keys[p] for p in good], [self.dst_ids[p] for p in good], result)
        else:
            self._settle(keys, self.dst_ids, result)
        if bad:
            self.failed(bad)
        self.ended()

    def _settle(self, keys: list[OffloadKey], dst_ids: list[int], result: TransferResult) -> None:
        """The copies `keys` (in `dst` slots `dst_ids`) were delivered: make them readable, count them."""
        if not keys:
            return
        src, dst = self.src, self.dst
        if not dst.table.mark_written(keys):  # (some block not being written any more): those still are
            get = dst.table.get
            dst.table.mark_written([k for k, slot in zip(keys, dst_ids)
                                    if (b := get(k)) is not None and b.block_id == slot and b.ref_cnt == -1])
        src.stats.bytes_out += result.transfer_size or 0
        src.stats.seconds_out += result.transfer_time or 0.0
        dst.stats.bytes_in += result.transfer_size or 0
        dst.stats.seconds_in += result.transfer_time or 0.0
        dst.stats.stores += len(keys)
        self.events.record(dst, keys, removed=False)
        self.landed(keys)

    def not_taken(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Of `keys`, the blocks the router reported delivered, those `dst` did not take after all
        (a shared tier's writes left unsent: `Publish`); none by default. Called at most once per
        job, before any block of it becomes readable; they are then removed from `dst` (being
        written there: never readable, no event, not counted as stores). A job type counts them here."""
        return []

    def landed(self, keys: list[OffloadKey]) -> None:
        """Bookkeeping of the job type after its blocks `keys` became readable in `dst`."""

    def failed(self, keys: list[OffloadKey]) -> None:
        """Bookkeeping of the job type after the copies of `keys` failed and were removed from `dst`."""

    def ended(self) -> None:
        """Bookkeeping of the job type once it is accounted for (after `landed` and `failed`)."""

    def __str__(self) -> str:
        return f"{self.kind} of {len(self.keys)} blocks {self.src.name} -> {self.dst.name}"


class Demotion(Job):
    """A copy of readable blocks of `src` down to the next tier `dst`."""

    kind = "demotion"

    def landed(self, keys: list[OffloadKey]) -> None:
        src, dst = self.src, self.dst
        src.stats.demotions += len(keys)
        src.clean.update(keys)
        if src.first_victims:  # (an ended session's blocks stay first victims below)
            dst.first_victims.update(dict.fromkeys(filter(src.first_victims.__contains__, keys)))
        if dst.writes_through:
            dst.unwritten.update(dict.fromkeys(keys))  # started by `Cascade.advance_writes`

    def failed(self, keys: list[OffloadKey]) -> None:
        src = self.src
        # (may be evicted now, counted as `cascade_dropped_failed`: a copy that failed may fail again)
        src.write_failed.update(set(keys).difference(src.table.absent(keys)))

    def ended(self) -> None:
        self.src.demoting -= len(self.keys)


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
        `deadline` (a `time.monotonic()` value) passed first. A bounded wait sleeps on the
        router's report condition instead of blocking in a handler, so a hung handler cannot
        hold it, and wakes as soon as a job reports."""
        if deadline is None:
            self._router.wait(list(self._jobs))
            return True
        return self._router.wait_finished(max(0.0, deadline - time.monotonic()))

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
