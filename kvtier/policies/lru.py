"""Least-recently-used replacement."""

from __future__ import annotations

from collections import OrderedDict
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

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
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
        chosen = list(islice(evictable(self.blocks.items(), protected), n))
        if len(chosen) < n:
            return None
        pop = self.blocks.pop
        for key, _ in chosen:
            pop(key)
        return chosen

    def victim_candidates(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return evictable(self.blocks.items(), set())

    def clear(self) -> None:
        self.blocks.clear()

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self) -> Iterable[OffloadKey]:
        return self.blocks.keys()
