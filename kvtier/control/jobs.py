"""Jobs the manager starts (copies between two tiers), the table of running ones, the event log.

A `Job` knows its tiers and blocks; when the engine reports it, `finish(result)` releases the
source pins, settles the destination blocks (readable, or removed on failure) and the byte
counters, then lets the job type do its own bookkeeping (`landed` / `failed`).

Each side of a job is held either as block objects (`src_blocks`, `dst_blocks`: what the
policy's `get` returned, or what was inserted) or, for a tier whose policy has batch calls
(`Tier.batch`), as slot ids only (`src_ids`, `dst_ids`): `pin_sources` and `enter_copies` take
the pins and make the copies' blocks, `finish` settles them through `release_loads` and
`mark_written`, with no block object or view per key.
"""

from __future__ import annotations

import time
from collections import deque as _consume
from collections.abc import Iterator
from itertools import compress, repeat
from operator import add, attrgetter, not_
from typing import cast

from kvtier.control.tier import Tier
from kvtier.engine import TransferEngine
from kvtier.keys import OffloadKey
from kvtier.specs import LoadStoreSpec
from kvtier.types import BlockStatus, OffloadingEvent, TransferResult

_ref_cnt = attrgetter("ref_cnt")
# One side of a job: its blocks (key by key), or their slot ids (`Tier.batch`); the other is None.
Side = tuple["list[BlockStatus] | None", "list[int] | None"]


def pin_sources(tier: Tier, keys: list[OffloadKey]) -> Side:
    """Pin readable blocks `keys` (distinct) of `tier` for a copy: `ref_cnt += 1` and `pin`.
    Through the policy's `pin_loads` when `tier.batch` (the slot ids, no block object), else
    key by key (the blocks); the caller checked that every key is readable."""
    if tier.batch:
        ids = tier.policy.pin_loads(keys)
        if ids is not None:
            return None, ids
    blocks = cast("list[BlockStatus]", list(map(tier.policy.get, keys)))
    # keys are distinct: one read and one write per block
    _consume(map(setattr, blocks, repeat("ref_cnt"), map(add, map(_ref_cnt, blocks), repeat(1))), 0)
    tier.policy.pin(keys)
    return blocks, None


def enter_copies(tier: Tier, keys: list[OffloadKey], tail_first: bool = False) -> Side:
    """Allocate slots of `tier` for `keys` (distinct, absent there; the caller made room), in
    their order, and insert them being written (`ref_cnt == -1`, pinned). Through the policy's
    `insert_written` when `tier.batch` (the slot ids), else `insert_many` (the blocks). With
    `tail_first` (a request's new blocks) they are inserted last key first, the last one named
    as the request's tail (the `CachePolicy.insert_many` contract); copies have no tail.

    Atomic under a policy error: when inserting or pinning raises (a third-party policy refusing
    a key), the keys already inserted are removed, the slots freed, and the error propagates."""
    step, tail = (-1, keys[-1] if keys else None) if tail_first else (1, None)
    if tier.batch:
        ids = tier.backend.allocate_block_ids(keys)
        try:
            tier.policy.insert_written(keys[::step], ids[::step], tail=tail)
        except BaseException:
            _undo_enter(tier, keys)
            tier.backend.free_block_ids(ids)
            raise
        return None, ids
    blocks = tier.backend.allocate_blocks(keys)
    try:
        tier.policy.insert_many(keys[::step], blocks[::step], tail=tail)
        tier.policy.pin(keys)
    except BaseException:
        _undo_enter(tier, keys)
        tier.backend.free_many(blocks)
        raise
    return blocks, None


def _undo_enter(tier: Tier, keys: list[OffloadKey]) -> None:
    """Take out of `tier`'s policy those of `keys` (all absent before `enter_copies`) that a
    failed insert left resident, unpinned first (as `complete_store` drops a failed write)."""
    inserted = [key for key in keys if tier.policy.get(key) is not None]
    tier.policy.unpin(inserted)
    for key in inserted:
        tier.policy.remove(key)


def side_spec(tier: Tier, keys: list[OffloadKey], side: Side) -> LoadStoreSpec:
    """Where one side of a copy is in `tier`: from its blocks, or from its slot ids."""
    blocks, ids = side
    if blocks is not None:
        return tier.backend.get_load_store_spec(keys, blocks)
    return tier.backend.spec_for_ids(keys, cast("list[int]", ids))


def _held(tier: Tier, keys: list[OffloadKey], blocks: list[BlockStatus]) -> list[BlockStatus]:
    """The blocks `tier`'s policy holds for `keys`, inserted as `blocks`: `blocks` themselves,
    or, from a policy that copied them (`CachePolicy.returns_views`), its views of the same slots."""
    if not tier.policy.returns_views:
        return blocks
    get = tier.policy.get
    return [v for v, b in zip(map(get, keys), blocks) if v is not None and v.block_id == b.block_id]


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
    """A copy of `keys` (distinct) from `src` (blocks pinned meanwhile) into new blocks of `dst`.
    Each side is given as its blocks or, with `src_ids` / `dst_ids`, as slot ids (blocks None)."""

    kind = "copy"

    def __init__(self, src: Tier, dst: Tier, keys: list[OffloadKey], src_blocks: list[BlockStatus] | None,
                 dst_blocks: list[BlockStatus] | None, events: EventLog, *,
                 src_ids: list[int] | None = None, dst_ids: list[int] | None = None):
        self.src, self.dst, self.keys = src, dst, keys
        self.src_blocks, self.dst_blocks = src_blocks, dst_blocks
        self.src_ids, self.dst_ids = src_ids, dst_ids
        self.events = events

    def source_blocks(self) -> list[BlockStatus]:
        """The source blocks: those kept, or `BlockStatus`es of the slot ids kept (their
        `block_id` is all they tell: for `Backend.still_valid` and comparisons)."""
        return self.src_blocks if self.src_blocks is not None else BlockStatus.many(cast("list[int]", self.src_ids))

    def finish(self, result: TransferResult) -> None:
        """Account for the engine's report of this job (called once)."""
        src, dst = self.src, self.dst
        if self.src_blocks is None:
            src.policy.release_loads(self.keys)  # (pinned by this job: resident)
        else:
            # C loops: `keys` are distinct, so each source block is in `src_blocks` once.
            ref_cnts = list(map(add, map(_ref_cnt, self.src_blocks), repeat(-1)))
            _consume(map(setattr, self.src_blocks, repeat("ref_cnt"), ref_cnts), 0)
            src.policy.unpin(list(compress(self.keys, map(not_, ref_cnts))))
        if result.success:
            if self.dst_blocks is not None:
                for block in _held(dst, self.keys, self.dst_blocks):  # (a loop writes a ctypes field faster)
                    block.ref_cnt = 0
                dst.policy.unpin(self.keys)
            elif not dst.policy.mark_written(self.keys):  # (some block not being written any more)
                get = dst.policy.get
                for key, block_id in zip(self.keys, cast("list[int]", self.dst_ids)):
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
            dst.policy.unpin(self.keys)
            remove = dst.policy.remove
            if self.dst_blocks is None:
                _consume(map(remove, self.keys), 0)
                dst.backend.free_block_ids(cast("list[int]", self.dst_ids))
            else:
                for key, block in zip(self.keys, self.dst_blocks):
                    remove(key)
                    dst.backend.free(block)
            self.failed()

    def landed(self) -> None:
        """Bookkeeping of the job type after its blocks became readable in `dst`."""

    def failed(self) -> None:
        """Bookkeeping of the job type after the copy failed and its `dst` blocks were removed."""

    def __str__(self) -> str:
        return f"{self.kind} of {len(self.keys)} blocks {self.src.name} -> {self.dst.name}"


class JobTable:
    """The jobs the manager submitted to the engine and has not yet accounted for, by job id."""

    def __init__(self, engine: TransferEngine):
        self._engine = engine
        self._jobs: dict[int, Job] = {}

    def submit(self, job: Job) -> None:
        src_spec = side_spec(job.src, job.keys, (job.src_blocks, job.src_ids))
        dst_spec = side_spec(job.dst, job.keys, (job.dst_blocks, job.dst_ids))
        job_id = self._engine.new_job_id()
        self._jobs[job_id] = job
        self._engine.submit(src_spec, dst_spec, job_id)

    def drain(self) -> None:
        """Account for every job the engine reported since the last call."""
        for result in self._engine.poll():
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                job.finish(result)

    def results_waiting(self) -> bool:
        """Whether the engine holds reports not drained yet (cheap)."""
        return self._engine.has_finished()

    def wait(self, deadline: float | None) -> bool:
        """Block until a running job reports (all of them when `deadline` is None); False when
        `deadline` (a `time.monotonic()` value) passed first. A bounded wait polls the engine
        instead of blocking in a handler, so a hung handler cannot hold it."""
        if deadline is None:
            self._engine.wait(list(self._jobs))
            return True
        pause = 0.0005
        while not self._engine.has_finished():
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
