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

`SIEVEOrder` keeps the queue (keys only); `SIEVECachePolicy` is it composed with the pure block
table (`kvtier.policies.pure.PurePolicy`), which holds the blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from kvtier.core.keys import OffloadKey
from kvtier.policies.pure import KeyOrder, PurePolicy, first


class SIEVEOrder(KeyOrder):
    """SIEVE's queue over keys (`kvtier.index.pure.Order`); `touch` is O(1) per key and moves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ahead: OrderedDict[OffloadKey, None] = OrderedDict()  # hand .. newest
        self.passed: OrderedDict[OffloadKey, None] = OrderedDict()  # oldest .. before the hand
        self.visited: set[OffloadKey] = set()

    def insert(self, keys: Sequence[OffloadKey], tail: OffloadKey | None) -> None:
        for key in keys:
            self.passed.pop(key, None)
            self.ahead[key] = None
            self.visited.discard(key)

    def remove(self, key: OffloadKey) -> None:
        if key in self.ahead:
            del self.ahead[key]
        else:
            self.passed.pop(key, None)
        self.visited.discard(key)
        self.pinned.discard(key)

    def touch(self, keys: list[OffloadKey]) -> None:
        ahead, passed, add = self.ahead, self.passed, self.visited.add
        for key in keys:
            if key in ahead or key in passed:
                add(key)

    def _order(self, protected: Collection[OffloadKey]) -> Iterator[OffloadKey]:
        """The hand's eviction order from now on, without moving it: unvisited keys ahead of the
        hand, then (after the wrap) unvisited passed keys, then the visited ones (their bits are
        cleared on the first pass) in the same two segments."""
        visited, pinned = self.visited, self.pinned
        for want_visited in (False, True):
            for segment in (self.ahead, self.passed):
                for key in segment:
                    if (key in visited) is want_visited and key not in pinned and key not in protected:
                        yield key

    def evict(self, n: int, skip: set[OffloadKey]) -> list[OffloadKey] | None:
        chosen = first(self._order(skip), n)
        if len(chosen) < n:
            return None
        # Move the hand exactly as far as SIEVE would to find these n victims.
        victims = set(chosen)
        ahead, passed, visited = self.ahead, self.passed, self.visited
        while victims:
            if not ahead:
                self.ahead, self.passed = ahead, passed = passed, ahead
            key, _ = ahead.popitem(last=False)
            visited.discard(key)
            if key in victims:
                victims.discard(key)
            else:
                passed[key] = None
        return chosen

    def victims(self, n: int, skip: Collection[OffloadKey]) -> list[OffloadKey]:
        return first(self._order(()), n, skip)

    def clear(self) -> None:
        self.ahead.clear()
        self.passed.clear()
        self.visited.clear()
        self.pinned.clear()


class SIEVECachePolicy(PurePolicy):
    """SIEVE (see the module docstring); its queue is the order's (`order`)."""

    def make_order(self) -> SIEVEOrder:
        return SIEVEOrder()
