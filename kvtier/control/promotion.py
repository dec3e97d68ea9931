"""Promotion: copying a block that a lookup found in a lower tier up into tier 0.

Used for tiers no handler can load straight into the engine's KV cache (staged path): the lookup
queues the promotion and answers RETRY; the queue is started at the end of the step, one
`Promotion` job per source tier; the lookup answers HIT once the block landed in tier 0. A
promotion that cannot start (its source went away, tier 0 has no room) or that fails is refused:
the next lookup of that key answers MISS, once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.control.cascade import Cascade
from kvtier.control.jobs import EventLog, Job, JobTable
from kvtier.control.tier import Tier
from kvtier.keys import OffloadKey
from kvtier.types import BlockStatus


class Promotion(Job):
    """A copy of readable blocks of a lower tier `src` up into tier 0 (`dst`)."""

    kind = "promotion"

    def __init__(self, promotions: Promotions, src: Tier, dst: Tier, keys: list[OffloadKey],
                 src_blocks: list[BlockStatus], dst_blocks: list[BlockStatus], events: EventLog):
        super().__init__(src, dst, keys, src_blocks, dst_blocks, events)
        self.promotions = promotions

    def landed(self) -> None:
        src, dst = self.src, self.dst
        self.promotions.ended(self.keys)
        src.stats.promotions += len(self.keys)
        if src.above is dst:
            dst.clean.update(self.keys)
        for key in self.keys:
            dst.promoted_from[key] = src.index

    def failed(self) -> None:
        """A block that could not be read back is not trusted again, unless its backend
        verified it (a job fails as a whole when one of its blocks is bad). The next lookup of
        each bad block answers MISS; when the backend named bad blocks, the others (read fine)
        are not refused and may be promoted again at once; when it named none (an I/O error),
        every block of the job is refused once, so that a failing tier cannot make a key
        answer RETRY forever."""
        src = self.src
        self.promotions.ended(self.keys)
        bad = [(key, block) for key, block in zip(self.keys, self.src_blocks) if not src.backend.still_valid(block)]
        for key, block in bad:
            if block.ref_cnt == 0 and src.policy.get(key) is block:
                src.drop(key, block)
                self.events.record(src, [key], removed=True)
        self.promotions.refused.update([key for key, _ in bad] if bad else self.keys)


class Promotions:
    """The promotion controller: which keys are being promoted, queued, or were refused."""

    def __init__(self, tiers: Sequence[Tier], jobs: JobTable, cascade: Cascade, events: EventLog):
        self._tiers = tiers
        self._top = tiers[0]
        self._jobs = jobs
        self._cascade = cascade
        self._events = events
        self.running: dict[OffloadKey, int] = {}  # key -> source tier index (queued or running)
        self.queue: dict[OffloadKey, None] = {}  # promotions to start at the end of the step
        self.refused: set[OffloadKey] = set()  # keys whose next lookup answers MISS

    def request(self, key: OffloadKey, src: Tier) -> None:
        """Queue a promotion of `key` from `src` (started by `flush`)."""
        self.running[key] = src.index
        self.queue[key] = None

    def take_refusal(self, key: OffloadKey) -> bool:
        """Whether the last promotion of `key` was refused (answered once)."""
        if key in self.refused:
            self.refused.discard(key)
            return True
        return False

    def supersede(self, keys: Iterable[OffloadKey]) -> None:
        """Cancel the queued (not started) promotions of `keys`: the engine stores them itself."""
        if self.queue:
            for key in keys:
                if key in self.queue:
                    del self.queue[key]
                    del self.running[key]

    def ended(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self.running.pop(key, None)

    def flush(self) -> None:
        """Start the queued promotions, one job per source tier. Source blocks are pinned first:
        making room in tier 0 may demote into (and so evict from) their tier. When tier 0 has no
        room for all of them, the longest prefix of the queue (in request order) that fits is
        started and only the rest is refused: a run longer than tier 0's room still comes up
        from its first block (`_room`)."""
        queue, self.queue = self.queue, {}
        top = self._top
        wanted: list[tuple[OffloadKey, Tier, BlockStatus]] = []
        for key in queue:
            src = self._tiers[self.running[key]]
            block = src.policy.get(key)
            if block is None or block.ref_cnt < 0 or top.policy.get(key) is not None:
                self._refuse(key)
                continue
            block.ref_cnt += 1  # held until the job ends (`Job.finish` releases it)
            wanted.append((key, src, block))
        by_tier: dict[int, list[OffloadKey]] = {}
        for key, src, _ in wanted:
            by_tier.setdefault(src.index, []).append(key)
        for index, keys in by_tier.items():
            self._tiers[index].policy.pin(keys)
        fit = self._room(top, [key for key, _, _ in wanted])
        for key, src, block in wanted[fit:]:
            block.ref_cnt -= 1
            self._refuse(key)
            if not block.ref_cnt:
                src.policy.unpin([key])
        jobs: dict[int, tuple[list[OffloadKey], list[BlockStatus]]] = {}
        for key, src, block in wanted[:fit]:
            entry = jobs.setdefault(src.index, ([], []))
            entry[0].append(key)
            entry[1].append(block)
        for index, (keys, src_blocks) in jobs.items():
            dst_blocks = top.backend.allocate_blocks(keys)
            top.policy.insert_many(keys, dst_blocks)
            top.policy.pin(keys)  # being written
            top.allocated_since_walk += len(keys)
            self._jobs.submit(Promotion(self, self._tiers[index], top, keys, src_blocks, dst_blocks, self._events))

    def _room(self, top: Tier, keys: list[OffloadKey]) -> int:
        """Make room in tier 0 for the longest prefix of `keys` that can get it; its length.
        Blocks promoted earlier and not loaded yet are not evicted for it: they are the hits of a
        lookup that is still to load them, and a run longer than tier 0 would otherwise evict
        its own head to promote its tail, again at every lookup (RETRY forever). Binary search
        on the prefix length: a success frees the slots it needs, a larger one tried after it
        only frees more."""
        if not keys:
            return 0
        kept = set(top.promoted_from) if top.promoted_from else set()
        if self._cascade.evict_for(top, len(keys), kept.union(keys)) is not None:
            return len(keys)
        lo, hi = 0, len(keys) - 1  # lo fits (nothing needed), hi + 1 does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._cascade.evict_for(top, mid, kept.union(keys[:mid])) is not None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _refuse(self, key: OffloadKey) -> None:
        del self.running[key]
        self.refused.add(key)
