"""Promotion: copying a block that a lookup found in a lower tier up into tier 0.

Used for tiers no handler can load straight into the engine's KV cache (staged path): the lookup
queues the promotion and answers RETRY; the queue is started at the end of the step, one
`Promotion` job per source tier; the lookup answers HIT once the block landed in tier 0. A
promotion that cannot start (its source went away, tier 0 has no room) or that fails is refused:
the next lookup of that key answers MISS, once (within `HOLD_S`). A run longer than tier 0 has
room for promotes the prefix that fits and refuses the rest.
"""

from __future__ import annotations

from collections import deque as _consume
from collections.abc import Callable, Collection, Iterable
from itertools import islice, repeat, takewhile
from time import monotonic

from kvtier.control.context import ControlContext
from kvtier.control.jobs import Job
from kvtier.control.tier import Tier, enter_copies
from kvtier.core.keys import OffloadKey

# How long a promotion's outcome is held for the engine, which acts on it within a step or two: a
# refusal answers the key's next lookup with MISS only within it, and a block promoted and not
# loaded yet is kept from other promotions' evictions only within it (an abandoned request's
# promotions would otherwise starve every later one, and its refusals answer MISS much later).
HOLD_S = 2.0
MAX_REFUSED = 65536  # refusals remembered at most (the oldest go first)


class Promotion(Job):
    """A copy of readable blocks of a lower tier `src` up into tier 0 (`dst`)."""

    kind = "promotion"
    reads_fail = True  # a block that failed is the lower tier's: condemned there (`Job.finish`)

    def __init__(self, promotions: Promotions, src: Tier, keys: list[OffloadKey], src_ids: list[int],
                 dst_ids: list[int]):
        super().__init__(promotions.ctx, src, promotions.ctx.top, keys, src_ids, dst_ids)
        self.promotions = promotions

    def landed(self, keys: list[OffloadKey]) -> None:
        src, dst = self.src, self.dst
        src.stats.promotions += len(keys)
        if src.above is dst:
            dst.clean.update(keys)
        dst.promoted_from.update(zip(keys, repeat(src.index)))
        self.promotions.hold(keys)

    def failed(self, keys: list[OffloadKey]) -> None:
        """The blocks `keys` could not be read back (gone, failing verification, unreachable):
        condemned in their tier by `Job.finish`; the next lookup of each answers MISS. The
        others of the job were promoted."""
        self.src.stats.rejected += len(keys)
        self.promotions.refuse(keys)

    def ended(self) -> None:
        self.promotions.ended(self.keys)


EvictFor = Callable[[Tier, int, Collection[OffloadKey]], "list[OffloadKey] | None"]


class Promotions:
    """The promotion controller: which keys are being promoted, queued, or were refused. Room in
    tier 0 is made by `evict_for` (`Cascade.evict_for`: eviction that respects the cascade). The
    clock is this module's `monotonic` (tests replace it)."""

    def __init__(self, ctx: ControlContext, evict_for: EvictFor):
        self.ctx = ctx
        self._tiers = ctx.tiers
        self._top = ctx.top
        self._jobs = ctx.jobs
        self._evict_for = evict_for
        self.running: dict[OffloadKey, int] = {}  # key -> source tier index (queued or running)
        self.queue: dict[OffloadKey, None] = {}  # promotions to start at the end of the step
        self.refused: dict[OffloadKey, float] = {}  # key -> when refused: its next lookup within HOLD_S answers MISS
        self.held: dict[OffloadKey, float] = {}  # promoted into tier 0, not loaded yet -> when it landed

    def request(self, key: OffloadKey, src: Tier) -> None:
        """Queue a promotion of `key` from `src` (started by `flush`)."""
        self.running[key] = src.index
        self.queue[key] = None

    def take_refusal(self, key: OffloadKey) -> bool:
        """Whether the last promotion of `key` was refused less than `HOLD_S` ago (answered once)."""
        when = self.refused.pop(key, None)
        return when is not None and when >= monotonic() - HOLD_S

    def refuse(self, keys: Iterable[OffloadKey]) -> None:
        """Answer the next lookup of each of `keys` with MISS (within `HOLD_S`)."""
        now = monotonic()
        refused = self.refused
        for key in keys:
            refused.pop(key, None)  # re-inserted last: the dict stays in time order
            refused[key] = now
        expire_stamps(refused, now - HOLD_S, MAX_REFUSED)

    def hold(self, keys: Iterable[OffloadKey]) -> None:
        """Keep `keys`, just promoted into tier 0, from other promotions' evictions for `HOLD_S`."""
        now = monotonic()
        held = self.held
        keys = list(keys)  # (distinct) moved to the end, in order: the dict stays in time order
        _consume(map(held.pop, keys, repeat(None)), 0)
        held.update(zip(keys, repeat(now)))
        expire_stamps(held, now - HOLD_S, self._top.capacity)

    def supersede(self, keys: Iterable[OffloadKey]) -> None:
        """Cancel the queued (not started) promotions of `keys`: the engine stores them itself."""
        if self.queue:
            for key in keys:
                if key in self.queue:
                    del self.queue[key]
                    del self.running[key]

    def ended(self, keys: Iterable[OffloadKey]) -> None:
        _consume(map(self.running.pop, keys, repeat(None)), 0)

    def flush(self) -> None:
        """Start the queued promotions, one job per source tier. Source blocks are pinned first:
        making room in tier 0 may demote into (and so evict from) their tier. A key no longer
        readable in its source, or already in tier 0, is refused. When tier 0 has no room for
        all of them, the longest prefix of the queue (in request order) that fits is started and
        only the rest is refused: a run longer than tier 0's room still comes up from its first
        block (`_room`); while copies down from tier 0 are in flight (they make room: a block not
        copied down is never evicted for a promotion), the rest stays queued instead."""
        queue, self.queue = self.queue, {}
        keys = list(queue)
        if not keys:
            return
        wanted, ids = self._pin(keys)
        fit = self._room(self._top, wanted)
        if fit < len(wanted):
            for index, positions in _by_source(self.running, wanted[fit:]).items():
                self._tiers[index].table.release_loads([wanted[fit + p] for p in positions])
            if self._top.demoting:  # room is being made (copies down in flight): tried again next step
                self.queue.update(dict.fromkeys(wanted[fit:]))
            else:
                for key in wanted[fit:]:
                    self._refuse(key)
        for index, positions in _by_source(self.running, wanted[:fit]).items():
            self._start(self._tiers[index], [wanted[p] for p in positions], [ids[p] for p in positions])

    def _pin(self, keys: list[OffloadKey]) -> tuple[list[OffloadKey], list[int]]:
        """Pin the source blocks of the queued `keys` (held until their job ends: `Job.finish`
        releases them, `pin_loads` per source tier); those to promote, in order, and their
        source slot ids. The others (not readable in their source, or in tier 0) are refused."""
        running, top = self.running, self._top
        absent = top.table.absent(keys)
        sources = _by_source(running, keys)
        if len(absent) == len(keys) and len(sources) == 1:  # the common case: one C pass
            ids = self._tiers[running[keys[0]]].table.pin_loads(keys)
            if ids is not None:
                return keys, ids
        free = set(absent)
        wanted: list[OffloadKey] = []
        for key in keys:
            if key in free and self._tiers[running[key]].readable(key) is not None:
                wanted.append(key)
            else:
                self._refuse(key)
        ids = [0] * len(wanted)
        for index, positions in _by_source(running, wanted).items():
            pinned = self._tiers[index].table.pin_loads([wanted[p] for p in positions])
            for p, block_id in zip(positions, pinned or ()):  # (readable: checked above)
                ids[p] = block_id
        return wanted, ids

    def _start(self, src: Tier, keys: list[OffloadKey], src_ids: list[int]) -> None:
        """Insert copies of `keys` (pinned in `src`, room made) into tier 0 and start their job."""
        top = self._top
        dst_ids = enter_copies(top, keys)  # being written: pinned
        top.allocated_since_walk += len(keys)
        self._jobs.submit(Promotion(self, src, keys, src_ids, dst_ids))

    def _room(self, top: Tier, keys: list[OffloadKey]) -> int:
        """Make room in tier 0 for the longest prefix of `keys` that can get it; its length.
        Blocks promoted less than `HOLD_S` ago and not loaded yet are not evicted for it: they
        are the hits of a lookup that is still to load them, and a run longer than tier 0 would
        otherwise evict its own head to promote its tail, again at every lookup (RETRY forever).
        Older ones are ordinary blocks: the request that wanted them may be gone. Binary search
        on the prefix length: a success frees the slots it needs, a larger one tried after it
        only frees more."""
        if not keys:
            return 0
        held = self.held
        expire_stamps(held, monotonic() - HOLD_S, top.capacity)
        promoted = top.promoted_from
        small, large = (held, promoted) if len(held) <= len(promoted) else (promoted, held)
        kept = {key for key in small if key in large}  # (iterating the smaller: held can reach the capacity)
        evict_for = self._evict_for
        return longest_fit(len(keys), lambda n: evict_for(top, n, kept.union(keys[:n])) is not None)

    def _refuse(self, key: OffloadKey) -> None:
        del self.running[key]
        self.refuse([key])


def _by_source(running: dict[OffloadKey, int], keys: list[OffloadKey]) -> dict[int, list[int]]:
    """Source tier index -> the positions of `keys` promoted from it (`running`), in order."""
    sources: dict[int, list[int]] = {}
    for pos, key in enumerate(keys):
        sources.setdefault(running[key], []).append(pos)
    return sources


def longest_fit(n: int, make_room: Callable[[int], bool]) -> int:
    """The largest `k <= n` for which `make_room(k)` (room made for the first `k` of `n` blocks)
    succeeds, trying `n` first, then by binary search (a success frees the room it needs; a larger
    one tried after it only frees more). `make_room(0)` is taken to succeed."""
    if n == 0 or make_room(n):
        return n
    lo, hi = 0, n - 1  # lo fits, hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if make_room(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def expire_stamps(stamps: dict[OffloadKey, float], before: float, most: int) -> None:
    """Drop the entries of a time-ordered `stamps` made before `before`, and the oldest beyond
    `most`. (The leading run made before `before` is counted in C: `takewhile` over the values.)"""
    drop = max(len(list(takewhile(before.__gt__, stamps.values()))), len(stamps) - most)
    if drop > 0:
        _consume(map(stamps.pop, list(islice(stamps, drop))), 0)
