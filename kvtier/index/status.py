"""The block-table calls that the two Python tables make alike over `BlockStatus` objects found
by `get`: `PureTable` over its own dict, `PolicyTable` over a policy written to vLLM's
`CachePolicy` (kvtier/index/table.py has the contract of each call). A block's state is its
`ref_cnt` (-1 being written, 0 readable, n pinned by n loads); a table says where new blocks go
(`_insert`) and tells its eviction order when blocks stop (`_pin`) or start again (`_unpin`)
being evictable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import filterfalse
from typing import cast

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus


class StatusCalls:
    """`BlockTable`'s reads and `ref_cnt` changes, written once for both Python tables."""

    def get(self, key: OffloadKey) -> BlockStatus | None:
        """The resident block of `key`, or None (a table binds its own lookup)."""
        raise NotImplementedError

    def _insert(self, keys: Sequence[OffloadKey], blocks: list[BlockStatus], tail: OffloadKey | None) -> None:
        """Make `blocks` resident under `keys` and tell the order (`tail`: the request's end)."""
        raise NotImplementedError

    def _pin(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` stopped being evictable (being written, or pinned once more)."""
        raise NotImplementedError

    def _unpin(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` (their `ref_cnt` back to 0) may be evicted again, unless a retention holds them."""
        raise NotImplementedError

    def _released_below(self, keys: list[OffloadKey]) -> None:
        """`keys` were released more often than pinned (`ref_cnt < 0`: not readable any more)."""

    def readable_run(self, keys: Sequence[OffloadKey]) -> int:
        get = self.get
        for n, key in enumerate(keys):
            block = get(key)
            if block is None or block.ref_cnt < 0:
                return n
        return len(keys)

    def absent(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        return list(filterfalse(self.get, keys))  # (a block, object or view, is truthy)

    def insert_written(self, keys: Sequence[OffloadKey], block_ids: Sequence[int],
                       tail: OffloadKey | None = None) -> None:
        if len(block_ids) != len(keys):
            raise ValueError(f"insert_written: {len(keys)} keys but {len(block_ids)} block ids")
        self._insert(keys, BlockStatus.many(block_ids), tail)
        self._pin(keys)

    def insert_ready(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        if len(block_ids) != len(keys):
            raise ValueError(f"insert_ready: {len(keys)} keys but {len(block_ids)} block ids")
        blocks = BlockStatus.many(block_ids)
        for block in blocks:
            block.ref_cnt = 0
        self._insert(keys, blocks, None)

    def pin_loads(self, keys: Sequence[OffloadKey]) -> list[int] | None:
        blocks = list(map(self.get, keys))
        if not all(block is not None and block.ref_cnt >= 0 for block in blocks):
            return None
        for block in cast("list[BlockStatus]", blocks):
            block.ref_cnt += 1
        try:
            self._pin(keys)
        except BaseException:  # (a user policy's notice raised: the pins are undone, none stays behind)
            for block in cast("list[BlockStatus]", blocks):
                block.ref_cnt -= 1
            raise
        return [cast("BlockStatus", block).block_id for block in blocks]

    def release_loads(self, keys: Sequence[OffloadKey]) -> None:
        blocks = list(map(self.get, keys))
        if None in blocks:
            raise KeyError(keys[blocks.index(None)])
        released, below = [], []
        for key, block in zip(keys, cast("list[BlockStatus]", blocks)):
            block.ref_cnt = ref_cnt = block.ref_cnt - 1  # (a ctypes field: read once)
            if ref_cnt == 0:
                released.append(key)
            elif ref_cnt < 0:
                below.append(key)
        self._unpin(released)
        if below:
            self._released_below(below)

    def mark_written(self, keys: Sequence[OffloadKey]) -> bool:
        blocks = list(map(self.get, keys))
        for i, block in enumerate(blocks):
            if block is None or block.ref_cnt != -1:  # (a key given twice: 0 at its second place)
                for earlier in cast("list[BlockStatus]", blocks[:i]):
                    earlier.ref_cnt = -1
                return False
            block.ref_cnt = 0
        self._unpin(keys)
        return True
