"""Prefix-aware, frequency-credited LRU for prefix caches (kvtier's own design, issue 8).

Registered as `prefix-freq`. A block is only worth keeping while every block before it in its
request is kept: the lookup stops at the first miss. What the Mooncake traces show (numbers in
docs/policies.md):

1. *Most stored blocks are never used again* (76% of the distinct blocks of the conversation
   trace), while a block that has been hit is more likely to be hit again (conversation: 0.26 for
   a block just stored, 0.42 after one hit, 0.50 after two, 0.84 after four; a conversation at
   turn t = 1..5 gets another turn with probability 0.33, 0.41, 0.48, 0.57, 0.70) and the gap to
   the next use does not grow with the count. So a block's value is its recency *plus a credit
   that grows with its hit count*.
2. *A block that was evicted and is stored again was needed*: the re-store counts as a hit (a
   ghost list of recently evicted keys, as in ARC, Megiddo & Modha FAST'03).
3. *The tail of a request is one-time.* The last block of a request is partial (its hash changes
   when the conversation grows): 98% (conversation) and 90% (synthetic) of them are never used
   again. While tails look one-time they are evicted before any other block. Whether this is
   right is checked online from departures: reuse rate = (hits while resident + re-stores after
   eviction) / (hits + evictions), for tails and for other new blocks; tails are one-time while
   their rate is below half of the new blocks' rate and below `tail_reuse_max` (10%). Otherwise
   they are ordinary new blocks (credit 0). (Synthetic at 40k blocks: 23% of the departing tails
   are reused, by exact repeats of a request; demoting them there lost to LRU.)
4. *Chains are cut from the deep end.* Hits are touched in prefix order and new blocks are
   inserted tail first (`HierarchyManager.prepare_store`), so a chain's head always carries the newest
   stamp; and a deeper block never has more hits than its parent (a request holding a block holds
   its prefix), so it never has more credit either. Eviction removes a chain from its deep end and
   leaves no unreachable (dead) blocks behind.

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

Contract: exactly `CachePolicy`'s (tests/policies/test_conformance.py): `victim_candidates`
yields the eviction order without any state change, and `evict` removes exactly n unpinned,
unprotected blocks or returns None and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Iterable, Iterator, Sequence
from heapq import heappush
from itertools import islice

from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy
from kvtier.types import BlockStatus

_TAIL = 0  # segment index of request tails; segment 1 + c holds the blocks with c hits
_INF = float("inf")


class PrefixFreqCachePolicy(CachePolicy):
    """Recency plus a per-hit-count credit; request tails first; chains cut from the deep end.

    State: `blocks` (key -> block, `get` is its bound `get`), `segs[i]` (key -> stamp, an LRU
    list per segment; a key is in exactly one segment), `ghosts` (evicted key -> its segment then,
    in eviction order), `_returns` (the tail/new-block reuse counters behind `_tails_one_time`).
    """

    # Tuned on the synthetic trace and generated workloads (docs/policies.md).
    credits: tuple[float, ...] = (0.0, 1.5, 3.0, 4.5)  # credit (in units) of a block with c hits
    tail_reuse_max = 0.1  # tails reused more often than this are not one-time (synthetic 40k: 23%)
    ghost_fraction = 6.0  # ghosts kept: between 1x and 2x this many capacities (keys only)
    max_ghost_limit = 4_000_000  # ... but at most 1-2x this many keys (about 0.4-0.8 GB): a bound
    # for tiers of more than ~670k blocks, which no measured workload reached
    unit_rate = 0.001  # weight of one hit in the running mean of hit ages
    demote_tail = True

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        # segs[0]: request tails; segs[1 + c]: blocks with c hits. key -> stamp (clock at the
        # last use); stamps increase along each segment.
        self.segs: list[OrderedDict[OffloadKey, int]] = [OrderedDict() for _ in range(len(self.credits) + 1)]
        self._new = self.segs[1]
        # touch looks a key up in the hit classes first (touched prefixes were hit before)
        self._probe = tuple(enumerate(self.segs))[::-1]
        self.blocks: dict[OffloadKey, BlockStatus] = {}
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]  # hot path: one C call
        self.clock = 0
        self.unit = float(cache_capacity)  # clock ticks per credit: running mean hit age
        # Ghosts: evicted key -> its segment then, oldest first; trimmed to ghost_limit keys
        # whenever they reach twice that (one C-level copy per ghost_limit evictions).
        self.ghosts: dict[OffloadKey, int] = {}
        self._ghost_pop = self.ghosts.pop
        self.ghost_limit = min(int(cache_capacity * self.ghost_fraction), self.max_ghost_limit)
        self._mark = 0  # len(blocks) when the clock was last synced (see insert)
        # evicted tails, returned tails (ghost hits), evicted new blocks, returned new blocks,
        # tails hit while resident, new blocks hit while resident
        self._returns = [0, 0, 0, 0, 0, 0]
        # Evictable accounting only (track_pins): pinned or protected keys met by an eviction's
        # walk are set aside, out of their segment: key -> (segment, sequence number, stamp).
        # The unpinned ones are served first, from `_freed[segment]` ((stamp, seq, key), a
        # heap): every aside key was met before the rest of its segment, so it is older than
        # all of it. A touched or evicted aside key is put back into its segment first.
        self.aside: dict[OffloadKey, tuple[int, int, int]] = {}
        self._aside_n = [0] * len(self.segs)
        self._freed: list[list[tuple[int, int, OffloadKey]]] = [[] for _ in self.segs]
        self._seq = 0

    def get(self, key: OffloadKey) -> BlockStatus | None:  # replaced per instance by blocks.get
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        # Contract: `key` is not resident (the manager inserts only keys that `get` did not find).
        # The clock is not advanced here: `_sync` adds the number of inserts at the next call,
        # so a request's new blocks share one stamp and are ordered by their list position.
        self.blocks[key] = block
        self._place(key)

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    tail: OffloadKey | None = None) -> None:
        self.blocks.update(zip(keys, blocks))
        if tail is not None and not self.demote_tail:
            tail = None
        if not self.ghosts.keys().isdisjoint(keys) or (tail is not None and (not keys or keys[0] != tail)):
            for key in keys:  # a returning ghost, or the tail not first: the per-key rules
                self._place(key, key == tail)
            return
        # No ghost among them (the common case): the tail (first, as the manager passes it),
        # then the rest in bulk (C loops).
        first = 0
        if tail is not None:
            self.segs[_TAIL][tail] = self.clock
            first = 1
        self._new.update(dict.fromkeys(islice(keys, first, None), self.clock))

    def _place(self, key: OffloadKey, tail: bool = False) -> None:
        """Put a just-inserted key into its segment: a returning ghost by its history, else the
        tail segment (`tail`, with `demote_tail`) or the new blocks."""
        ghost = self._ghost_pop(key, None)
        if ghost is None:
            if tail and self.demote_tail:
                self.segs[_TAIL][key] = self.clock
            else:
                self._new[key] = self.clock
            return
        # Evicted, then needed again: the re-store counts as a hit.
        if ghost <= 1:
            self._returns[1 if ghost == _TAIL else 3] += 1
        segs = self.segs
        segs[min(max(ghost, 1) + 1, len(segs) - 1)][key] = self.clock

    def _sync(self) -> int:
        """Advance the clock by the blocks inserted since the last call that synced; returns it."""
        n = len(self.blocks)
        self.clock += n - self._mark
        self._mark = n
        return self.clock

    def remove(self, key: OffloadKey) -> None:
        self._sync()
        if self.blocks.pop(key, None) is not None:
            for seg in self.segs:
                if seg.pop(key, None) is not None:
                    break
        self._mark = len(self.blocks)
        self._forget_pin(key)
        if self.aside:
            self._unaside([key], restore=False)

    def _unaside(self, keys: Iterable[OffloadKey], restore: bool = True) -> None:
        """Keys that are touched, evicted or removed are no longer aside; with `restore` they go
        back into their segment (with their stamp), for the caller to move or delete them."""
        pop, counts, segs = self.aside.pop, self._aside_n, self.segs
        for key in keys:
            entry = pop(key, None)
            if entry is not None:
                counts[entry[0]] -= 1
                if restore:
                    segs[entry[0]][key] = entry[2]

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        pinned = self._pinned
        if pinned is None:
            return
        if not self.aside:
            pinned.difference_update(keys)
            return
        aside, freed = self.aside, self._freed
        for key in keys:
            pinned.discard(key)
            entry = aside.get(key)
            if entry is not None:
                index, seq, stamp = entry
                heappush(freed[index], (stamp, seq, key))

    def _lane(self, index: int) -> Iterator[tuple[OffloadKey, int]]:
        """(key, stamp) of segment `index` in its order: its unpinned aside keys first."""
        if not self._freed[index]:
            return iter(self.segs[index].items())
        return self._lane_with_aside(index)

    def _lane_with_aside(self, index: int) -> Iterator[tuple[OffloadKey, int]]:
        aside, pinned = self.aside, self._pinned or set()
        seen = set()
        for stamp, seq, key in sorted(self._freed[index]):
            if aside.get(key) == (index, seq, stamp) and key not in pinned and key not in seen:
                seen.add(key)
                yield key, stamp
        yield from self.segs[index].items()

    def _set_aside(self, met: list[tuple[int, OffloadKey]]) -> None:
        """Take the pinned and protected keys an eviction met out of their segments' order."""
        aside, pinned, segs, freed, counts = self.aside, self._pinned, self.segs, self._freed, self._aside_n
        assert pinned is not None
        seq = self._seq
        for index, key in met:
            if key in aside or key not in self.blocks:
                continue  # aside already (a freed key protected this time), or evicted
            stamp = segs[index].pop(key)
            aside[key] = (index, seq, stamp)
            counts[index] += 1
            if key not in pinned:  # protected this time, evictable
                heappush(freed[index], (stamp, seq, key))
            seq += 1
        self._seq = seq
        for index, heap in enumerate(freed):
            if len(heap) > 2 * counts[index] + 64:  # drop stale entries now and then
                freed[index] = [e for e in heap if aside.get(e[2]) == (index, e[1], e[0])]

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        segs = self.segs
        new = segs[1]
        top = len(segs) - 1
        probe = self._probe
        clock, unit, rate = self._sync(), self.unit, self.unit_rate
        pop_new = new.pop
        returns = self._returns
        keys = keys if isinstance(keys, list) else list(keys)
        if self.aside:
            self._unaside(keys)  # touched: back in the order of the segment they move to
        for key in reversed(keys):
            stamp = pop_new(key, None)
            if stamp is not None:
                seg = 1
                returns[5] += 1
            else:
                for seg, lane in probe:  # noqa: B007 - seg is read after the loop: where the key was found
                    stamp = lane.pop(key, None)
                    if stamp is not None:
                        break
                else:
                    continue
                if seg == _TAIL:
                    returns[4] += 1
            clock += 1
            unit += (clock - stamp - unit) * rate
            segs[seg + 1 if 0 < seg < top else (2 if seg == _TAIL else top)][key] = clock
        self.clock = clock
        self.unit = unit

    def _tails_one_time(self) -> bool:
        """Whether request tails are reused less than half as often as other new blocks, and by
        fewer than `tail_reuse_max` of them (so that demoting them is right on this workload);
        false until 64 tails and 64 other new blocks have left (demoting tails on no evidence
        cost 2 hits at synthetic 40k, where exact repeats reuse them).

        A tail or new block leaves its segment either by a hit (touch) or by eviction; reuse rate
        = (hits + re-stores of evicted ones) / (hits + evictions). Counting resident hits, not
        only ghost returns, gives the evidence before the tier is under pressure."""
        te, tr, ne, nr, th, nh = self._returns
        if te + th < 64 or ne + nh < 64:
            return False
        reused, left = th + tr, th + te
        return reused * (nh + ne) < 0.5 * (nh + nr) * left and reused < self.tail_reuse_max * left

    def _heads(self, protected: set[OffloadKey], first: int,
               met: list[tuple[int, OffloadKey]] | None = None) -> list[list]:
        """Per non-empty segment from `first` on: [score of its first evictable block, key, block,
        iterator, offset, segment index, keys taken so far]. Offset = credit * unit (tails: 0).
        The keys passed over (pinned, protected) are appended to `met` when it is given."""
        blocks, unit, credits = self.blocks, self.unit, self.credits
        lanes: list[list] = []
        segs = self.segs
        freed = self._freed
        for index in range(first, len(segs)):
            if segs[index] or freed[index]:  # (a segment may hold only aside keys)
                it = self._lane(index)
                for key, stamp in it:
                    block = blocks[key]
                    if block.ref_cnt == 0 and key not in protected:
                        offset = credits[index - 1] * unit if index else 0.0
                        lanes.append([stamp + offset, key, block, it, offset, index, []])
                        break
                    if met is not None:
                        met.append((index, key))
        return lanes

    def _order(self, protected: set[OffloadKey]) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Evictable blocks in eviction order (no state change); the same walk as `evict`:
        one-time request tails first, then by increasing score, ties to the lower segment."""
        blocks = self.blocks
        first = 0
        if self._tails_one_time():
            first = 1
            for key, _ in self._lane(_TAIL):
                block = blocks[key]
                if block.ref_cnt == 0 and key not in protected:
                    yield key, block
        lanes = self._heads(protected, first)
        while lanes:
            best = lanes[0]
            limit = _INF
            for lane in lanes[1:]:
                score = lane[0]
                if score < best[0]:
                    limit = best[0]
                    best = lane
                elif score < limit:
                    limit = score
            yield best[1], best[2]
            # Stay in this lane while its scores stay below every other lane's head.
            below = limit - best[4]
            for key, stamp in best[3]:
                block = blocks[key]
                if block.ref_cnt == 0 and key not in protected:
                    if stamp >= below:
                        best[0], best[1], best[2] = stamp + best[4], key, block
                        break
                    yield key, block
            else:
                lanes.remove(best)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        if self._refuses(n, protected):
            return None  # fewer than n evictable blocks, known without looking at the pinned ones
        # The walk of _order, without a generator (this is the hot path).
        blocks = self.blocks
        chosen: list[tuple[OffloadKey, BlockStatus]] = []
        append = chosen.append
        left = n
        first = 0
        tails: list[OffloadKey] = []
        met: list[tuple[int, OffloadKey]] | None = None if self._pinned is None else []
        if self._tails_one_time():
            first = 1
            take = tails.append
            for key, _ in self._lane(_TAIL):
                block = blocks[key]
                if block.ref_cnt == 0 and key not in protected:
                    append((key, block))
                    take(key)
                    left -= 1
                    if not left:
                        break
                elif met is not None:
                    met.append((_TAIL, key))
        lanes = self._heads(protected, first, met) if left else []
        used = lanes[:]
        while lanes:
            best = lanes[0]
            limit = _INF
            for lane in lanes[1:]:
                score = lane[0]
                if score < best[0]:
                    limit = best[0]
                    best = lane
                elif score < limit:
                    limit = score
            take = best[6].append
            append((best[1], best[2]))
            take(best[1])
            left -= 1
            if not left:
                break
            below = limit - best[4]
            for key, stamp in best[3]:
                block = blocks[key]
                if block.ref_cnt == 0 and key not in protected:
                    if stamp >= below:
                        best[0], best[1], best[2] = stamp + best[4], key, block
                        break
                    append((key, block))
                    take(key)
                    left -= 1
                    if not left:
                        break
                elif met is not None:
                    met.append((best[5], key))
            else:
                lanes.remove(best)
                continue
            if not left:
                break
        if left:
            return None
        self._sync()
        if self.aside:
            self._unaside([key for key, _ in chosen])  # back into their segments, deleted below
        segs, ghosts, returns = self.segs, self.ghosts, self._returns
        if tails:
            used.append([0, 0, 0, 0, 0, _TAIL, tails])
        for lane in used:
            taken = lane[6]
            if not taken:
                continue
            index = lane[5]
            if len(taken) == 1:
                key = taken[0]
                del segs[index][key]
                del blocks[key]
                ghosts[key] = index
            else:
                # Bulk bookkeeping at C speed (map + a zero-length deque run the loop in C).
                _consume(map(segs[index].__delitem__, taken), 0)
                _consume(map(blocks.__delitem__, taken), 0)
                ghosts.update(dict.fromkeys(taken, index))
            if index <= 1:
                returns[0 if index == _TAIL else 2] += len(taken)
        self._mark = len(blocks)
        if met:
            self._set_aside(met)
        limit = self.ghost_limit
        if len(ghosts) >= 2 * limit:
            self.ghosts = ghosts = dict(islice(ghosts.items(), len(ghosts) - limit, None)) if limit else {}
            self._ghost_pop = ghosts.pop
        return chosen

    def victim_candidates(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return self._order(set())

    def clear(self) -> None:
        for seg in self.segs:
            seg.clear()
        self.blocks.clear()
        self.ghosts.clear()
        self._returns = [0, 0, 0, 0, 0, 0]
        self.clock = self._mark = 0
        self.unit = float(self.cache_capacity)
        if self._pinned is not None:
            self._pinned.clear()
        self.aside.clear()
        self._aside_n = [0] * len(self.segs)
        self._freed = [[] for _ in self.segs]

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self) -> Iterable[OffloadKey]:
        return list(self.blocks)
