"""Prefix-aware, frequency-credited LRU for prefix caches (kvtier's own design, issue 8).

`PurePrefixFreqCachePolicy` is the pure-Python twin of the registered `prefix-freq`
(`kvtier.policies.prefix_compiled.PrefixFreqCachePolicy`, a compiled index making the same
decisions) and its fallback where the extension is not built; the design is explained here. It is
`PurePrefixFreqOrder` (keys, stamps, ghosts; no blocks) composed with the pure block table
(`kvtier.policies.pure.PurePolicy`), which holds the blocks and tells the order of pins.

A block is worth keeping only while every block before it in its request is kept (the lookup
stops at the first miss). So a block's value is its recency plus a credit that grows with its hit
count; a re-stored ghost (a recently evicted key) counts as a hit; a request's tail, while tails
look one-time (their reuse rate, measured online from departures, below half of the other new
blocks' and below `tail_reuse_max`), is evicted before any other block; chains are cut from their
deep end (hits are touched in prefix order, new blocks inserted tail first, and a deeper block
never has more hits than its parent). The evidence from the Mooncake traces behind each rule is in
docs/policies.md ("prefix-freq").

Mechanism: a logical clock advances by one per block inserted or touched (inserts are added in
bulk at the next other call, so a request's new blocks share one stamp; their order within a
segment is the insertion order). A block of class c (c = hits since stored, capped at
`len(credits) - 1`) scores `stamp + credits[c] * unit`; after the one-time tails, the lowest
score is evicted first. `unit` is a running mean of the age (in clock ticks) of the blocks that
get hit, so credits are measured in "typical reuse intervals" of the workload and do not depend
on the capacity. Each class is an LRU list (stamps increase along it), so the eviction order is a
k-way merge of the class lists that compares only the lists' heads: a run of victims is taken
from one list while it stays below the other heads. Cost: per inserted block three dict
operations (block map, ghost lookup, segment), per victim one lookup plus two deletions and one
ghost store (done per segment with C-level map/dict.fromkeys), per touched key one pop per
segment probed and one store; O(classes) per run of victims.

Which block is a request's tail: the caller says so, `insert_many(keys, blocks, tail=key)` (the
`CachePolicy` contract); the manager passes the last new block of each engine store, and no tail
for copies between tiers (demotions, promotions). `insert` never inserts a tail.

Contract: exactly `CachePolicy`'s (tests/policies/test_conformance.py) and `Order`'s
(`kvtier.index.pure`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from itertools import compress, repeat
from operator import is_, is_not
from typing import Any, cast

from kvtier.core.keys import OffloadKey
from kvtier.policies.prefix_aside import AsideBlocks
from kvtier.policies.prefix_ghosts import GhostList
from kvtier.policies.prefix_runs import _TAIL, _forget, _heads, _merged, _probes, _take_tails, _walk_lanes
from kvtier.policies.prefix_tails import (
    HIT_NEW,
    HIT_TAIL,
    RETURNED_NEW,
    RETURNED_TAIL,
    TailEvidence,
)
from kvtier.policies.pure import KeyOrder, PurePolicy, first


class PurePrefixFreqOrder(KeyOrder):
    """Recency plus a per-hit-count credit; request tails first; chains cut from the deep end
    (`kvtier.index.pure.Order`; `tuning`: the policy class, see `PurePrefixFreqCachePolicy`).

    State: `segs[i]` (key -> stamp, an LRU list per segment; a resident key is in exactly one
    segment or aside), `size` (resident keys). Parts with one job each: `ghost_list` (`GhostList`:
    evicted keys), `tail_evidence` (`TailEvidence`: the tail rule), `_aside` (`AsideBlocks`:
    pinned keys kept out of the order, `aside`).
    """

    def __init__(self, cache_capacity: int, tuning: Any) -> None:
        super().__init__()
        self.cache_capacity = cache_capacity
        self.credits: tuple[float, ...] = tuple(tuning.credits)
        self.tail_reuse_max, self.unit_rate = tuning.tail_reuse_max, tuning.unit_rate
        self.demote_tail = tuning.demote_tail
        # segs[0]: request tails; segs[1 + c]: blocks with c hits. key -> stamp (clock at the
        # last use); stamps increase along each segment.
        self.segs: list[OrderedDict[OffloadKey, float]] = [OrderedDict() for _ in range(len(self.credits) + 1)]
        self._new = self.segs[1]
        # touch: a key found in segment s moves to segment 2 (s = 0) or min(s + 1, top). A touched
        # prefix, reversed, is runs of keys with more and more hits (its tail first), so a key not
        # in the segment of the key before it is looked for in the segments above first:
        # _probe[s] = [segment s's pop, the segment its keys move to, the probes after s].
        self._probe = _probes(self.segs)
        # a returning ghost evicted from segment s is stored again into _returns_to[s] (see _place_many)
        top = len(self.segs) - 1
        self._returns_to = tuple(min(max(seg, 1) + 1, top) for seg in range(top + 1))
        self.size = 0
        self.clock = 0.0  # a float holding an integer (exact below 2**53): touch's arithmetic stays float
        self.unit = float(cache_capacity)  # clock ticks per credit: running mean hit age
        self.ghost_list = GhostList(min(int(cache_capacity * tuning.ghost_fraction), tuning.max_ghost_limit))
        self._mark = 0  # size when the clock was last synced (see insert)
        self.tail_evidence = TailEvidence()
        self._aside = AsideBlocks(self.segs)  # `aside` is the parts' dict (never replaced)
        self.aside = self._aside.entries

    def insert(self, keys: Sequence[OffloadKey], tail: OffloadKey | None) -> None:
        # Contract: `keys` are not resident. The clock is not advanced here: `_sync` adds the
        # number of inserts at the next call, so a request's new blocks share one stamp and are
        # ordered by their list position.
        self.size += len(keys)
        if tail is not None and not self.demote_tail:
            tail = None
        if not self.ghost_list.evicted.keys().isdisjoint(keys) or (tail is not None and (not keys or keys[0] != tail)):
            _place_many(self, keys, tail)  # a returning ghost, or the tail not first
            return
        # No ghost among them (the common case): the tail (first, as the manager passes it),
        # then the rest (stored one by one: an OrderedDict's `update` from pairs makes an
        # iterator per pair, which costs more than the loop).
        clock, new, it = self.clock, self._new, iter(keys)
        if tail is not None:
            self.segs[_TAIL][next(it)] = clock
        for key in it:
            new[key] = clock

    def _sync(self) -> float:
        """Advance the clock by the keys inserted since the last call that synced; returns it."""
        n = self.size
        self.clock += n - self._mark
        self._mark = n
        return self.clock

    def remove(self, key: OffloadKey) -> None:
        self._sync()
        self.size -= 1
        for seg in self.segs:
            if seg.pop(key, None) is not None:
                break
        self._mark = self.size
        self.pinned.discard(key)
        if self.aside:
            self._aside.unaside([key], restore=False)

    def evictable(self, keys: list[OffloadKey], flag: bool) -> None:
        if not flag or not self.aside or self.aside.keys().isdisjoint(keys):
            super().evictable(keys, flag)
            return
        self._aside.unpin(keys, self.pinned)

    def touch(self, keys: list[OffloadKey]) -> None:
        clock, unit, rate = self._sync(), self.unit, self.unit_rate
        if self.aside and not self.aside.keys().isdisjoint(keys):
            self._aside.unaside(keys)  # touched: back in the order of the segment they move to
        # Nothing enters the tails or the new blocks here, so what leaves them was hit.
        tails, new = self.segs[_TAIL], self._new
        n_tails, n_new = len(tails), len(new)
        # A key is in one segment, so the order of the probes does not matter; the segment of the
        # previous key goes first (a touched prefix is a few runs of keys of one segment).
        pop, dest, after = self._probe[_TAIL]
        for key in reversed(keys):
            stamp = pop(key, None)
            if stamp is None:
                for pop, dest, after in after:  # noqa: B007,B020 - read after the loop: where the key was
                    stamp = pop(key, None)
                    if stamp is not None:
                        break
                else:
                    continue
            clock += 1.0
            unit += (clock - stamp - unit) * rate
            dest[key] = clock
        counts = self.tail_evidence.counts
        counts[HIT_NEW] += n_new - len(new)
        counts[HIT_TAIL] += n_tails - len(tails)
        self.clock = clock
        self.unit = unit

    def _order(self, protected: Collection[OffloadKey]) -> Iterator[OffloadKey]:
        """Evictable keys in eviction order (no state change); the same walk as `evict`:
        one-time request tails first, then by increasing score, ties to the lower segment."""
        pinned = self.pinned
        first_seg = 0
        if self.tail_evidence.one_time(self.tail_reuse_max):
            first_seg = 1
            for key, _ in self._aside.lane(_TAIL, pinned):
                if key not in pinned and key not in protected:
                    yield key
        yield from _merged(_heads(self, protected, first_seg), pinned, protected)

    def evict(self, n: int, skip: set[OffloadKey]) -> list[OffloadKey] | None:
        pinned = self.pinned
        # The walk of _order, without a generator (this is the hot path).
        chosen: list[OffloadKey] = []
        left = n
        first_seg = 0
        tails: list[OffloadKey] = []
        met: list[tuple[int, OffloadKey]] = []
        if self.tail_evidence.one_time(self.tail_reuse_max):
            first_seg = 1
            aside = self._aside
            lane = aside.lane(_TAIL, pinned) if aside.freed[_TAIL] else self.segs[_TAIL].items()
            left = _take_tails(lane, left, pinned, skip, chosen, tails, met)
        lanes = _heads(self, skip, first_seg, met) if left else []
        used = lanes[:]
        if _walk_lanes(lanes, left, pinned, skip, chosen, met):
            return None
        self._sync()
        if self.aside:
            self._aside.unaside(chosen)  # back into their segments, deleted below
        if tails:
            used.append([0, 0, 0, 0, _TAIL, tails])
        _forget(used, self.segs, self.ghost_list.evicted, self.tail_evidence.counts)
        self.size -= len(chosen)
        self._mark = self.size
        if met:
            self._aside.set_aside(met, pinned)
        ghosts = self.ghost_list
        if len(ghosts.evicted) >= 2 * ghosts.limit:
            ghosts.trim()
        return chosen

    def victims(self, n: int, skip: Collection[OffloadKey]) -> list[OffloadKey]:
        return first(self._order(()), n, skip)

    def clear(self) -> None:
        for seg in self.segs:
            seg.clear()
        self.size = 0
        self.ghost_list.clear()
        self.tail_evidence.clear()
        self.clock, self._mark = 0.0, 0
        self.unit = float(self.cache_capacity)
        self.pinned.clear()
        self._aside.clear()


class PurePrefixFreqCachePolicy(PurePolicy):
    """`PurePrefixFreqOrder` composed with the pure block table; the order's state is inspected
    through the properties below (the compiled class has the same)."""

    # Tuned on the synthetic trace and generated workloads (docs/policies.md).
    credits: tuple[float, ...] = (0.0, 1.5, 3.0, 4.5)  # credit (in units) of a block with c hits
    tail_reuse_max = 0.1  # tails reused more often than this are not one-time (synthetic 40k: 23%)
    ghost_fraction = 6.0  # ghosts kept: between 1x and 2x this many capacities (keys only)
    max_ghost_limit = 4_000_000  # ... but at most 1-2x this many keys (about 0.4-0.8 GB): a bound
    # for tiers of more than ~670k blocks, which no measured workload reached
    unit_rate = 0.001  # weight of one hit in the running mean of hit ages
    demote_tail = True

    def make_order(self) -> PurePrefixFreqOrder:
        return PurePrefixFreqOrder(self.cache_capacity, type(self))

    @property
    def segs(self) -> list[OrderedDict[OffloadKey, float]]:
        return self.order.segs

    @property
    def aside(self) -> dict[OffloadKey, tuple[int, int, float]]:
        return self.order.aside

    @property
    def clock(self) -> float:
        return self.order.clock

    @property
    def unit(self) -> float:
        return self.order.unit

    @property
    def ghosts(self) -> dict[OffloadKey, int]:
        """Evicted key -> its segment then, oldest first (read-only view of the ghost list)."""
        return self.order.ghost_list.evicted

    @property
    def ghost_limit(self) -> int:
        """Ghosts kept: between 1x and 2x this many keys."""
        return self.order.ghost_list.limit

    @ghost_limit.setter
    def ghost_limit(self, limit: int) -> None:
        self.order.ghost_list.limit = limit

    @property
    def tail_counts(self) -> list[int]:
        """The departures of tails and new blocks (`TailEvidence.counts`, a copy); settable."""
        return list(self.order.tail_evidence.counts)

    @tail_counts.setter
    def tail_counts(self, counts: list[int]) -> None:
        self.order.tail_evidence.counts = [int(v) for v in counts]


def _place_many(policy: PurePrefixFreqOrder, keys: Sequence[OffloadKey], tail: OffloadKey | None) -> None:
    """Place each of `keys` (distinct, just inserted), in order, a segment at a time: a returning
    ghost by its history, else the tail segment (`tail`) or the new blocks. Each segment receives
    its keys in the order of `keys`, and the segments are independent lists."""
    clock, segs = policy.clock, policy.segs
    history = list(map(policy.ghost_list.pop, keys, repeat(None)))  # segment evicted from, or None
    fresh = list(map(is_, history, repeat(None)))
    if tail is not None and tail in keys:
        at = keys.index(tail)
        if fresh[at]:  # (a returning tail is placed by its history)
            segs[_TAIL][tail] = clock
            fresh[at] = False
    new = policy._new
    for key in compress(keys, fresh):  # (a loop: OrderedDict.update makes an iterator per pair)
        new[key] = clock
    returning = list(map(is_not, history, repeat(None)))
    if not any(returning):
        return
    # Evicted, then needed again: the re-store counts as a hit.
    was = cast("list[int]", list(compress(history, returning)))
    counts = policy.tail_evidence.counts
    counts[RETURNED_TAIL] += was.count(_TAIL)
    counts[RETURNED_NEW] += was.count(1)
    back = list(compress(keys, returning))
    into = list(map(policy._returns_to.__getitem__, was))
    for index in sorted(set(into)):
        seg = segs[index]
        for key in compress(back, map(index.__eq__, into)):
            seg[key] = clock
