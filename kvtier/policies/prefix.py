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
   again. Tails get a negative credit. Whether this is right is checked online: if evicted tails
   come back at least half as often as evicted new blocks, tails are treated as new blocks.
4. *Chains are cut from the deep end.* Hits are touched in prefix order and new blocks are
   inserted tail first (manager.prepare_store), so a chain's head always carries the newest
   stamp; and a deeper block never has more hits than its parent (a request holding a block holds
   its prefix), so it never has more credit either. Eviction removes a chain from its deep end and
   leaves no unreachable (dead) blocks behind.

Mechanism: a logical clock advances by one per block inserted or touched. A block of class c
(c = hits since stored, capped at `len(credits) - 1`) scores `stamp + credits[c] * unit`; the
lowest score is evicted first. `unit` is a running mean of the age (in clock ticks) of the blocks
that get hit, so credits are measured in "typical reuse intervals" of the workload and do not
depend on the capacity. Each class is an LRU list (stamps increase along it), so the eviction
order is a k-way merge of the class lists: O(classes) per victim, O(1) per insert and per
touched key.

Which insert is a request's tail: the manager calls `touch(hits)`, then `evict` when it needs
room, then `insert` once per new block, tail first. The first `insert` after any other
state-changing call (touch, evict, remove, clear) is taken as the tail. When the tier is not full
and a request has no hits, nothing separates two requests' inserts, so the second tail is kept as
an ordinary new block (a missed demotion, nothing worse). This reading of the call sequence only
holds for the first tier (engine stores); lower tiers receive demotion batches, and should use
`lru`.

Contract: exactly `CachePolicy`'s (tests/policies/test_conformance.py): `victim_candidates`
yields the eviction order without any state change, and `evict` removes exactly n unpinned,
unprotected blocks or returns None and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy
from kvtier.types import BlockStatus

_TAIL = 0  # segment index of request tails; segment 1 + c holds the blocks with c hits


class PrefixFreqCachePolicy(CachePolicy):
    """Recency plus a per-hit-count credit; request tails first; chains cut from the deep end."""

    # Tuned on the synthetic trace and generated workloads (docs/policies.md).
    credits: tuple[float, ...] = (0.0, 1.5, 3.0, 4.5)  # credit (in units) of a block with c hits
    tail_credit = -3.0  # credit of a request tail, while tails look one-time
    ghost_fraction = 6.0  # ghosts kept: between 1x and 2x this many capacities (keys only)
    unit_rate = 0.001  # weight of one hit in the running mean of hit ages
    demote_tail = True

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        # segs[0]: request tails; segs[1 + c]: blocks with c hits. Each is an LRU list (stamps increase).
        self.segs: list[OrderedDict[OffloadKey, BlockStatus]] = [OrderedDict() for _ in range(len(self.credits) + 1)]
        self.blocks: dict[OffloadKey, BlockStatus] = {}
        self.get = self.blocks.get  # type: ignore[method-assign]  # hot path: one C call
        # key -> (stamp << 3) | segment index: one dict for both (stamp = clock at the last use)
        self.meta: dict[OffloadKey, int] = {}
        self.clock = 0
        self.unit = float(cache_capacity)  # clock ticks per credit: running mean hit age
        self._in_run = False  # the next insert continues a run (is not a request tail)
        # Ghosts: evicted key -> its segment then. Two generations of up to ghost_limit keys
        # each (the older one is dropped as a whole), so remembering costs one dict store.
        self.ghosts: dict[OffloadKey, int] = {}
        self.old_ghosts: dict[OffloadKey, int] = {}
        self.ghost_limit = int(cache_capacity * self.ghost_fraction)
        # evicted tails, returned tails, evicted new blocks, returned new blocks (ghost hits)
        self._returns = [0, 0, 0, 0]

    def get(self, key: OffloadKey) -> BlockStatus | None:  # replaced per instance by blocks.get
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        # Contract: `key` is not resident (the manager inserts only keys that `get` did not find).
        clock = self.clock = self.clock + 1
        self.blocks[key] = block
        ghost = self.ghosts.pop(key, None)
        if ghost is None:
            ghost = self.old_ghosts.pop(key, None)
        if ghost is None:
            seg = 1 if self._in_run or not self.demote_tail else _TAIL
        else:
            # Evicted, then needed again: the re-store counts as a hit.
            if ghost <= 1:
                self._returns[1 if ghost == _TAIL else 3] += 1
            seg = min(max(ghost, 1) + 1, len(self.segs) - 1)
        self.segs[seg][key] = block
        self.meta[key] = (clock << 3) | seg
        self._in_run = True

    def remove(self, key: OffloadKey) -> None:
        self._in_run = False
        meta = self.meta.pop(key, None)
        if meta is not None:
            del self.segs[meta & 7][key]
            del self.blocks[key]

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._in_run = False
        metas, segs = self.meta, self.segs
        top = len(segs) - 1
        clock, unit, rate = self.clock, self.unit, self.unit_rate
        for key in reversed(list(keys)):
            meta = metas.get(key)
            if meta is None:
                continue
            clock += 1
            unit += (clock - (meta >> 3) - unit) * rate
            seg = meta & 7
            new = seg + 1 if 0 < seg < top else (2 if seg == _TAIL else top)
            if new == seg:
                segs[seg].move_to_end(key)
            else:
                segs[new][key] = segs[seg].pop(key)
            metas[key] = (clock << 3) | new
        self.clock = clock
        self.unit = unit

    def _offsets(self) -> list[float]:
        unit = self.unit
        tail = (self.tail_credit if self._tails_one_time() else 0.0) * unit
        return [tail] + [c * unit for c in self.credits]

    def _order(self, protected: set[OffloadKey]) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Evictable blocks by increasing score, ties to the lower segment (no state change)."""
        metas = self.meta
        lanes = self._heads(protected)
        while lanes:
            best = lanes[0]
            for lane in lanes:
                if lane[0] < best[0]:
                    best = lane
            limit = min((lane[0] for lane in lanes if lane is not best), default=float("inf"))
            yield best[1], best[2]
            # Stay in this lane while it keeps the lowest score.
            offset = best[4]
            for key, block in best[3]:
                if block.ref_cnt == 0 and key not in protected:
                    score = (metas[key] >> 3) + offset
                    if score >= limit:
                        best[0], best[1], best[2] = score, key, block
                        break
                    yield key, block
            else:
                lanes.remove(best)

    def _tails_one_time(self) -> bool:
        """Whether evicted request tails come back less often than evicted new blocks (so that
        demoting them is right on this workload); true until enough evidence says otherwise."""
        te, tr, ne, nr = self._returns
        if te < 64 or ne < 64:
            return True
        return tr * ne < 0.5 * nr * te

    def _heads(self, protected: set[OffloadKey]) -> list[list]:
        """Per non-empty segment: [score of its first evictable block, key, block, iterator,
        offset, segment index, keys taken so far]."""
        metas = self.meta
        lanes: list[list] = []
        for index, (seg, offset) in enumerate(zip(self.segs, self._offsets())):
            if seg:
                it = iter(seg.items())
                for key, block in it:
                    if block.ref_cnt == 0 and key not in protected:
                        lanes.append([(metas[key] >> 3) + offset, key, block, it, offset, index, []])
                        break
        return lanes

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        # Same walk as _order, without a generator (this is the hot path).
        metas = self.meta
        lanes = self._heads(protected)
        used = list(lanes)
        chosen: list[tuple[OffloadKey, BlockStatus]] = []
        append = chosen.append
        left = n
        while lanes and left:
            best = lanes[0]
            limit = float("inf")
            if len(lanes) > 1:
                for lane in lanes:
                    if lane[0] < best[0]:
                        best = lane
                limit = min(lane[0] for lane in lanes if lane is not best)
            taken = best[6].append
            append((best[1], best[2]))
            taken(best[1])
            left -= 1
            if not left:
                break
            offset = best[4]
            for key, block in best[3]:
                if block.ref_cnt == 0 and key not in protected:
                    score = (metas[key] >> 3) + offset
                    if score >= limit:
                        best[0], best[1], best[2] = score, key, block
                        break
                    append((key, block))
                    taken(key)
                    left -= 1
                    if not left:
                        break
            else:
                lanes.remove(best)
        if left:
            return None
        self._in_run = False
        segs, blocks, ghosts = self.segs, self.blocks, self.ghosts
        for lane in used:
            taken, index = lane[6], lane[5]
            if not taken:
                continue
            seg = segs[index]
            for key in taken:
                del seg[key]
                del blocks[key]
                del metas[key]
            if index <= 1:
                self._returns[0 if index == _TAIL else 2] += len(taken)
            if self.ghost_limit:
                ghosts.update(dict.fromkeys(taken, index))
        if len(ghosts) >= self.ghost_limit:
            self.old_ghosts = ghosts
            self.ghosts = {}
        return chosen

    def victim_candidates(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return self._order(set())

    def clear(self) -> None:
        for seg in self.segs:
            seg.clear()
        self.blocks.clear()
        self.meta.clear()
        self.ghosts.clear()
        self.old_ghosts.clear()
        self._returns = [0, 0, 0, 0]
        self.clock = 0
        self.unit = float(self.cache_capacity)
        self._in_run = False

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self) -> Iterable[OffloadKey]:
        return list(self.blocks)
