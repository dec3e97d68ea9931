"""The pure-Python block table, twin of the compiled `CompactTable`: `PureTable` owns key ->
`BlockStatus` and the pins, composed with an `Order` that only orders keys. kvtier's pure
policies (the pure `lru` and `prefix-freq`, ARC, SIEVE) are such a pair (kvtier/policies/pure.py).

The table tells its order of every change, keys in the caller's order: new keys (`insert`, with
the request's tail), uses (`touch`), departures that are not evictions (`remove`) and pins
(`evictable`: False when a block starts being written or read, True when its `ref_cnt` is back
to 0); the order names victims (`victims`) and gives them up (`evict`).

Blocks given through vLLM's calls (`insert`, `insert_many`) may have their `ref_cnt` set through
`get`. Until the first `evictable` notice (`table_of` sends one) the table reads them again before
each decision; from then on every change is notified (`CachePolicy.evictable`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus
from kvtier.index.status import StatusCalls


class Order(Protocol):
    """Which resident keys leave first. Holds keys and ordering state, no blocks."""

    def insert(self, keys: Sequence[OffloadKey], tail: OffloadKey | None) -> None:
        """New resident keys, evictable until told otherwise; `tail`: the one that ends a
        request (`CachePolicy.insert_many`)."""

    def touch(self, keys: list[OffloadKey]) -> None:
        """Keys used (`CachePolicy.touch`; keys not resident are ignored)."""

    def remove(self, key: OffloadKey) -> None:
        """A resident key leaves, not as an eviction."""

    def evictable(self, keys: list[OffloadKey], flag: bool) -> None:
        """Resident keys stopped (False) or started (True) being evictable (a key may be told twice)."""

    def victims(self, n: int, skip: Collection[OffloadKey]) -> list[OffloadKey]:
        """The keys `evict(n, skip)` would take now, in order (fewer if there are fewer), changing nothing."""

    def evict(self, n: int, skip: set[OffloadKey]) -> list[OffloadKey] | None:
        """Take exactly `n` (> 0) evictable keys not in `skip`, or return None and change nothing."""

    def clear(self) -> None:
        """Forget every key and all history."""


class PureBlocks:
    """key -> `BlockStatus`, the pins and the order, with vLLM's `CachePolicy` calls (the part of
    `PureTable` a `kvtier.policies.pure.PurePolicy` binds). `pinned` counts the blocks not
    evictable by the notices; `held`, the keys the order was told not to evict (those, and the
    blocks whose `ref_cnt != 0`: a notice may say a block is pinned, by a copy, or evictable, and
    its `ref_cnt` still decides)."""

    def __init__(self, order: Order) -> None:
        self.order = order
        self.blocks: dict[OffloadKey, BlockStatus] = {}
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]  # hot path: one C call
        self.pinned: set[OffloadKey] = set()
        self.held: set[OffloadKey] = set()
        self.kept: set[OffloadKey] = set()  # held by a retention (`PureTable.hold`): pinned whatever their ref_cnt
        self.told = False  # an `evictable` notice came: from then on every change is notified

    def get(self, key: OffloadKey) -> BlockStatus | None:  # replaced per instance by blocks.get
        return self.blocks.get(key)

    def keys(self) -> Iterable[OffloadKey]:
        return self.blocks.keys()

    def __len__(self) -> int:
        return len(self.blocks)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.order.touch(keys if isinstance(keys, list) else list(keys))

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.insert_many([key], [block])

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    tail: OffloadKey | None = None) -> None:
        self._insert(keys, blocks, tail)
        held = [key for key, block in zip(keys, blocks) if block.ref_cnt]
        if held:
            self._tell(held, False)  # (counted as pinned when notified, as by `insert_written`)

    def remove(self, key: OffloadKey) -> None:
        if self.blocks.pop(key, None) is not None:
            self.pinned.discard(key)
            self.held.discard(key)
            self.kept.discard(key)
            self.order.remove(key)

    def evictable(self, keys: Iterable[OffloadKey], flag: bool) -> None:
        """`CachePolicy.evictable`; the first notice starts the accounting (reading every block)."""
        blocks = self.blocks
        if not self.told:
            self.told = True
            self.pinned = {k for k, b in blocks.items() if b.ref_cnt} | self.kept  # (the notices to come say more)
            self._reread(list(blocks))
        keys = [k for k in keys if k in blocks and not (flag and k in self.kept)]
        if flag:
            self.pinned.difference_update(keys)
            self._tell([k for k in keys if blocks[k].ref_cnt == 0], True)
        else:
            self.pinned.update(keys)
            self._tell(keys, False)

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        return self._checked(n, skip) if n > 0 else []

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        if self._refuses(n, protected) or len(self._checked(n, protected)) < n:
            return None
        taken = self._take(n, protected)
        return None if taken is None else list(zip(*taken))

    def clear(self) -> None:
        self.blocks.clear()
        self.pinned.clear()
        self.held.clear()
        self.kept.clear()
        self.order.clear()

    def _insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus], tail: OffloadKey | None) -> None:
        """Make `blocks` resident under `keys` and tell the order (`tail`: the request's end)."""
        self.blocks.update(zip(keys, blocks))
        self.order.insert(keys, tail)

    def _pin(self, keys: Sequence[OffloadKey]) -> None:
        """The table pinned `keys` (told as given: a key may already be held)."""
        self.pinned.update(keys)
        self.held.update(keys)
        self.order.evictable(list(keys), False)

    def _unpin(self, keys: Sequence[OffloadKey]) -> None:
        """The table made `keys` evictable (their `ref_cnt` is 0), but those a retention holds."""
        if self.kept:
            keys = [k for k in keys if k not in self.kept]
        if keys:
            self.pinned.difference_update(keys)
            self.held.difference_update(keys)
            self.order.evictable(list(keys), True)

    def _tell(self, keys: list[OffloadKey], flag: bool) -> None:
        """Tell the order of the `keys` that change, for it, to evictable (`flag`) or not."""
        held = self.held
        if flag and self.kept:
            keys = [k for k in keys if k not in self.kept]
        keys = [k for k in dict.fromkeys(keys) if (k in held) is flag]
        if keys:
            if flag:
                held.difference_update(keys)
            else:
                held.update(keys)
            self.order.evictable(keys, flag)

    def _reread(self, keys: list[OffloadKey]) -> None:
        """Tell the order of the `keys` whose `ref_cnt` changed through `get` (not notified)."""
        blocks = self.blocks
        self._tell([k for k in keys if blocks[k].ref_cnt], False)
        self._tell([k for k in keys if blocks[k].ref_cnt == 0], True)

    def _checked(self, n: int, skip: Collection[OffloadKey]) -> list[OffloadKey]:
        """The order's `victims(n, skip)`, read again until none has `ref_cnt != 0` (set through
        `get`); before the first notice the held blocks are read again first."""
        blocks = self.blocks
        if not self.told:
            self._tell([k for k in self.held if blocks[k].ref_cnt == 0], True)
        while True:
            victims = self.order.victims(n, skip)
            held = [k for k in victims if blocks[k].ref_cnt]
            if not held:
                return victims
            self._tell(held, False)

    def _refuses(self, n: int, protected: Collection[OffloadKey]) -> bool:
        """Whether the notices prove that fewer than `n` blocks not `protected` are evictable (False
        before the first notice); O(len(protected)) at most."""
        if not self.told:
            return False
        blocks, pinned = self.blocks, self.pinned
        free = len(blocks) - len(pinned)
        return free < n + len(protected) and free - sum(1 for k in protected if k in blocks and k not in pinned) < n

    def _take(self, n: int, protected: set[OffloadKey]) -> tuple[list[OffloadKey], list[BlockStatus]] | None:
        """Evict `n` (> 0) blocks the order names: their keys and blocks, or None (nothing changed)."""
        keys = self.order.evict(n, protected)
        if keys is None:
            return None
        return keys, list(map(self.blocks.pop, keys))


class PureTable(PureBlocks, StatusCalls):
    """The pure-Python `BlockTable` (see `kvtier.index.table.BlockTable`) over an `Order`."""

    def _released_below(self, keys: list[OffloadKey]) -> None:
        self._tell(keys, False)  # (not readable: not evictable either)

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self.remove(key)

    def evict_ids(self, n: int, protected: set[OffloadKey]) -> tuple[list[OffloadKey], list[int]] | None:
        if n <= 0:
            return [], []
        if self._refuses(n, protected) or (not self.told and len(self._checked(n, protected)) < n):
            return None
        taken = self._take(n, protected)
        return None if taken is None else (taken[0], [block.block_id for block in taken[1]])

    def evictable_count(self, protected: Collection[OffloadKey] = ()) -> int | None:
        if not self.told:
            return None  # (before the first notice, as the compiled table)
        pinned, blocks = self.pinned, self.blocks
        return len(blocks) - len(pinned) - sum(1 for k in protected if k not in pinned and k in blocks)

    def pinned_keys(self) -> set[OffloadKey] | None:
        return set(self.pinned) if self.told else None

    def hold(self, keys: Iterable[OffloadKey], held: bool = True) -> None:
        blocks, kept = self.blocks, self.kept
        if held:
            new = [k for k in keys if k in blocks and k not in kept]
            kept.update(new)
            self.pinned.update(new)
            self._tell(new, False)
            return
        gone = [k for k in keys if k in kept]
        kept.difference_update(gone)
        self._unpin([k for k in gone if blocks[k].ref_cnt == 0])

    def __repr__(self) -> str:
        return f"PureTable({type(self.order).__name__}, {len(self)} blocks)"
