"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03) for a tier of pinned-able blocks.

T1 holds blocks seen once recently, T2 blocks seen at least twice; B1/B2 remember keys recently
evicted from T1/T2 (ghosts, no data). A miss that hits a ghost list moves the target size `p` of
T1 towards the list that would have kept the block, and the block enters T2.

`ARCOrder` keeps the four lists (keys only); `ARCCachePolicy` is it composed with the pure block
table (`kvtier.policies.pure.PurePolicy`), which holds the blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from itertools import islice

from kvtier.core.keys import OffloadKey
from kvtier.policies.pure import KeyOrder, PurePolicy


class ARCOrder(KeyOrder):
    """ARC's lists over keys (`kvtier.index.pure.Order`)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__()
        self.cache_capacity = cache_capacity
        self.t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target_t1_size: float = 0.0

    def insert(self, keys: Sequence[OffloadKey], tail: OffloadKey | None) -> None:
        c = self.cache_capacity
        for key in keys:
            if key in self.b1:
                self.target_t1_size = min(self.target_t1_size + max(1.0, len(self.b2) / len(self.b1)), c)
                del self.b1[key]
                self.t2[key] = None
            elif key in self.b2:
                self.target_t1_size = max(self.target_t1_size - max(1.0, len(self.b1) / len(self.b2)), 0.0)
                del self.b2[key]
                self.t2[key] = None
            else:
                self.t1[key] = None
            self._trim_ghosts()  # keep |T1| + |B1| <= c and |B1| + |B2| <= c after every change

    def remove(self, key: OffloadKey) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)
        self.pinned.discard(key)

    def touch(self, keys: list[OffloadKey]) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def _choose(self, protected: Collection[OffloadKey]) -> Iterator[tuple[int, OffloadKey]]:
        """Victims in ARC's REPLACE order given the current target (no state change). Keys that
        may not go (pinned, `protected`) are passed over without counting: T1 shrinks only by the
        keys taken from it (as vLLM's ARC counts). The paper's rule decides ties: T1 gives a key
        while it holds more than the target (vLLM's: at least the target; docs/policies.md)."""
        pinned = self.pinned
        it1 = (k for k in self.t1 if k not in pinned and k not in protected)
        it2 = (k for k in self.t2 if k not in pinned and k not in protected)
        next1, next2 = next(it1, None), next(it2, None)
        t1_len = len(self.t1)
        while next1 is not None or next2 is not None:
            if next1 is not None and (t1_len > self.target_t1_size or next2 is None):
                yield 1, next1
                t1_len -= 1
                next1 = next(it1, None)
            else:
                assert next2 is not None  # the loop condition with the branch not taken
                yield 2, next2
                next2 = next(it2, None)

    def evict(self, n: int, skip: set[OffloadKey]) -> list[OffloadKey] | None:
        chosen = list(islice(self._choose(skip), n))
        if len(chosen) < n:
            return None
        for source, key in chosen:
            if source == 1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        self._trim_ghosts()
        return [key for _, key in chosen]

    def _trim_ghosts(self) -> None:
        c = self.cache_capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.b1) + len(self.b2) > c:
            (self.b2 if self.b2 else self.b1).popitem(last=False)

    def victims(self, n: int, skip: Collection[OffloadKey]) -> list[OffloadKey]:
        return [key for _, key in islice(self._choose(skip), max(n, 0))]

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.target_t1_size = 0.0
        self.pinned.clear()


class ARCCachePolicy(PurePolicy):
    """ARC (see the module docstring); its lists are the order's (`order`)."""

    def make_order(self) -> ARCOrder:
        return ARCOrder(self.cache_capacity)

    @property
    def t1(self) -> OrderedDict[OffloadKey, None]:
        return self.order.t1

    @property
    def t2(self) -> OrderedDict[OffloadKey, None]:
        return self.order.t2

    @property
    def b1(self) -> OrderedDict[OffloadKey, None]:
        return self.order.b1

    @property
    def b2(self) -> OrderedDict[OffloadKey, None]:
        return self.order.b2

    @property
    def target_t1_size(self) -> float:
        return self.order.target_t1_size

    @target_t1_size.setter
    def target_t1_size(self, size: float) -> None:
        self.order.target_t1_size = size
