"""SIEVE (Zhang et al., "SIEVE is Simpler than LRU: an Efficient Turn-Key Eviction Algorithm for Web
Caches", NSDI'24).

One FIFO queue plus a `visited` bit per block. A hit only sets the bit (no list move). A *hand*
walks from the oldest block towards the newest: a visited block has its bit cleared and stays where
it is, the first unvisited block is evicted; at the newest block the hand wraps to the oldest.
New blocks enter at the newest end, so a scan of one-time blocks is evicted before a block that was
reused, while blocks reused once keep their place only until the hand passes them again.

Representation: the queue is cut at the hand into `passed` (oldest .. just before the hand, already
passed in this round) and `ahead` (the hand .. newest; new blocks are appended here). Both are
insertion-ordered dicts; passing a block moves it from the front of `ahead` to the end of `passed`,
which keeps the queue order; a wrap makes `passed` the new `ahead`.

Pinned (`ref_cnt != 0`) and protected blocks are never evicted: the hand passes over them (and
clears their bit) as over a visited block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus
from kvtier.policies.base import CachePolicy, first_keys


class SIEVECachePolicy(CachePolicy):
    """SIEVE replacement; `touch` is O(1) per key and moves nothing."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.ahead: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()  # hand .. newest
        self.passed: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()  # oldest .. before the hand
        self.visited: set[OffloadKey] = set()

    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self.ahead.get(key)
        return block if block is not None else self.passed.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.passed.pop(key, None)
        self.ahead[key] = block
        self.visited.discard(key)

    def remove(self, key: OffloadKey) -> None:
        if self.ahead.pop(key, None) is None:
            self.passed.pop(key, None)
        self.visited.discard(key)
        self._forget_pin(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        ahead, passed, add = self.ahead, self.passed, self.visited.add
        for key in keys:
            if key in ahead or key in passed:
                add(key)

    def _order(self, protected: set[OffloadKey]) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """The hand's eviction order from now on, without moving it: unvisited blocks ahead of the
        hand, then (after the wrap) unvisited passed blocks, then the visited ones (their bits are
        cleared on the first pass) in the same two segments."""
        visited = self.visited
        for want_visited in (False, True):
            for segment in (self.ahead, self.passed):
                for key, block in segment.items():
                    if (key in visited) is want_visited and block.ref_cnt == 0 and key not in protected:
                        yield key, block

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        if self._refuses(n, protected):
            return None  # fewer than n evictable blocks, known without looking at the pinned ones
        chosen: list[tuple[OffloadKey, BlockStatus]] = []
        for entry in self._order(protected):
            chosen.append(entry)
            if len(chosen) == n:
                break
        else:
            return None
        # Move the hand exactly as far as SIEVE would to find these n victims.
        victims = {key for key, _ in chosen}
        ahead, passed, visited = self.ahead, self.passed, self.visited
        while victims:
            if not ahead:
                self.ahead, self.passed = ahead, passed = passed, ahead
            key, block = ahead.popitem(last=False)
            if key in victims:
                victims.discard(key)
                visited.discard(key)
            else:
                visited.discard(key)
                passed[key] = block
        return chosen

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        return first_keys(self._order(set()), n, skip)

    def clear(self) -> None:
        self.ahead.clear()
        self.passed.clear()
        self.visited.clear()
        if self._pinned is not None:
            self._pinned.clear()

    def __len__(self) -> int:
        return len(self.ahead) + len(self.passed)

    def keys(self) -> Iterable[OffloadKey]:
        return [*self.passed.keys(), *self.ahead.keys()]
