"""Least-recently-used replacement."""

from __future__ import annotations

from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy, evictable
from kvtier.types import BlockStatus


class LRUCachePolicy(CachePolicy):
    """Evicts the least recently inserted or touched unpinned block first."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]  # hot path (every lookup): one C call

    def get(self, key: OffloadKey) -> BlockStatus | None:  # replaced per instance by blocks.get
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    tail: OffloadKey | None = None) -> None:
        self.blocks.update(zip(keys, blocks))

    def remove(self, key: OffloadKey) -> None:
        self.blocks.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        blocks = self.blocks
        move = blocks.move_to_end
        for key in reversed(list(keys)):
            if key in blocks:
                move(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        chosen = list(islice(self.blocks.items(), n))
        keys = [key for key, _ in chosen]
        if len(chosen) < n or not protected.isdisjoint(keys) or any(block.ref_cnt for _, block in chosen):
            # Some of the n oldest are pinned or protected (or too few blocks): filter them.
            chosen = list(islice(evictable(self.blocks.items(), protected), n))
            if len(chosen) < n:
                return None
            keys = [key for key, _ in chosen]
        _consume(map(self.blocks.__delitem__, keys), 0)
        return chosen

    def victim_candidates(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return evictable(self.blocks.items(), set())

    def clear(self) -> None:
        self.blocks.clear()

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self) -> Iterable[OffloadKey]:
        return self.blocks.keys()
