"""`PurePolicy`: a pure-Python block table (`kvtier.index.pure.PureTable`) composed with a pure
eviction order (`kvtier.index.pure.Order`), answering vLLM's `CachePolicy` calls; `KeyOrder`, the
base of kvtier's pure orders (lru_pure.py, prefix_pure.py, arc.py, sieve.py)."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from itertools import filterfalse, islice
from typing import Any

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus
from kvtier.index.pure import Order, PureTable
from kvtier.policies.base import CachePolicy, OnTable


class KeyOrder:
    """Base of a pure order: `pinned`, the resident keys its table said are not evictable."""

    def __init__(self) -> None:
        self.pinned: set[OffloadKey] = set()

    def evictable(self, keys: list[OffloadKey], flag: bool) -> None:
        if flag:
            self.pinned.difference_update(keys)
        else:
            self.pinned.update(keys)


def first(keys: Iterator[OffloadKey], n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
    """The first `n` of `keys` not in `skip`."""
    return list(islice(filterfalse(skip.__contains__, keys) if skip else keys, max(n, 0)))


_CALLS = ("get", "insert", "insert_many", "remove", "touch", "evict", "victims", "evictable")


class PurePolicy(OnTable, CachePolicy):
    """Base of a pure policy: `table`, a `PureTable` composed with `order` (`make_order`). The
    table holds the blocks (`get` returns the objects given to `insert`) and is the tier's block
    table (`table_of`) unless a subclass overrides one of vLLM's calls (`composed` is False: the
    tier goes through them, `PolicyTable`); the order holds keys only."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.order: Any = self.make_order()
        self.table = PureTable(self.order)
        self.composed = all(getattr(type(self), name) is getattr(PurePolicy, name) for name in _CALLS)
        if self.composed:
            self.get = self.table.get  # type: ignore[method-assign]  # hot path: one C call

    @property
    def blocks(self) -> dict[OffloadKey, BlockStatus]:
        """The table's blocks, key -> block (read them; change them through `get`)."""
        return self.table.blocks

    def make_order(self) -> Order:
        """The order this policy's table is composed with."""
        raise NotImplementedError

    def get(self, key: OffloadKey) -> BlockStatus | None:  # replaced per instance by the table's
        return self.table.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.table.insert_many([key], [block])

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    tail: OffloadKey | None = None) -> None:
        self.table.insert_many(keys, blocks, tail)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)}/{self.cache_capacity} blocks)"

