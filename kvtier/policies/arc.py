"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03) for a tier of pinned-able blocks.

T1 holds blocks seen once recently, T2 blocks seen at least twice; B1/B2 remember keys recently
evicted from T1/T2 (ghosts, no data). A miss that hits a ghost list moves the target size `p` of
T1 towards the list that would have kept the block, and the block enters T2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from itertools import islice

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus
from kvtier.policies.base import CachePolicy, evictable


class ARCCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target_t1_size: float = 0.0

    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        c = self.cache_capacity
        if key in self.b1:
            self.target_t1_size = min(self.target_t1_size + max(1.0, len(self.b2) / len(self.b1)), c)
            del self.b1[key]
            self.t2[key] = block
        elif key in self.b2:
            self.target_t1_size = max(self.target_t1_size - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]
            self.t2[key] = block
        else:
            self.t1[key] = block
        self._trim_ghosts()  # keep |T1| + |B1| <= c and |B1| + |B2| <= c after every change

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)
        self._forget_pin(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(list(keys)):
            block = t1.pop(key, None)
            if block is not None:
                t2[key] = block
            elif key in t2:
                t2.move_to_end(key)

    def _choose(self, protected: Collection[OffloadKey]) -> Iterator[tuple[int, OffloadKey, BlockStatus]]:
        """Victims in ARC's REPLACE order given the current target (no state change). Blocks
        that may not go (pinned, `protected`) are passed over without counting: T1 shrinks only
        by the blocks taken from it (as vLLM's ARC counts). The paper's rule decides ties: T1
        gives a block while it holds more than the target (vLLM's: at least the target;
        docs/policies.md)."""
        it1 = evictable(self.t1.items(), protected)
        it2 = evictable(self.t2.items(), protected)
        next1, next2 = next(it1, None), next(it2, None)
        t1_len = len(self.t1)
        while next1 is not None or next2 is not None:
            if next1 is not None and (t1_len > self.target_t1_size or next2 is None):
                yield 1, next1[0], next1[1]
                t1_len -= 1
                next1 = next(it1, None)
            else:
                assert next2 is not None  # the loop condition with the branch not taken
                yield 2, next2[0], next2[1]
                next2 = next(it2, None)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        if self._refuses(n, protected):
            return None  # fewer than n evictable blocks, known without looking at the pinned ones
        chosen: list[tuple[int, OffloadKey, BlockStatus]] = []
        for entry in self._choose(protected):
            chosen.append(entry)
            if len(chosen) == n:
                break
        else:
            return None
        for source, key, _ in chosen:
            if source == 1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        self._trim_ghosts()
        return [(key, block) for _, key, block in chosen]

    def _trim_ghosts(self) -> None:
        c = self.cache_capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.b1) + len(self.b2) > c:
            (self.b2 if self.b2 else self.b1).popitem(last=False)

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        return [key for _, key, _ in islice(self._choose(skip), max(n, 0))]

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.target_t1_size = 0.0
        if self._pinned is not None:
            self._pinned.clear()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def keys(self) -> Iterable[OffloadKey]:
        return [*self.t1.keys(), *self.t2.keys()]
