"""The block table of a tier: key -> slot, block state and load pins, behind one batch API over
slot ids (`BlockTable`), so the control plane never handles a block object.

A block is *being written* (`ref_cnt == -1`: its slot is allocated, its bytes are not there
yet), *readable* (`ref_cnt == 0`) or *pinned* by `n` running loads or copies (`ref_cnt == n`).
Every call takes or returns keys and slot ids (`block_id`s) in the order given.

Two implementations:
- the compiled table (`kvtier/index/_table.pxd`/`_table.pyx`: keys, slots, states, pins, with
  a parallel array for the eviction order's per-block record; `_table_api.pyx`: `CompactTable`,
  these calls in C loops). The compiled `lru` and `prefix-freq` (`kvtier.policies.lru_compiled`,
  `prefix_compiled`) cimport it and keep only their eviction order, so such a policy is its own
  table (`CachePolicy.batch_calls`);
- `PolicyTable` is the pure-Python table over any `CachePolicy` (ARC, SIEVE, the pure twins, a
  policy written to vLLM's seed contract): the blocks are the policy's `BlockStatus` objects,
  found with `get`, and it tells the policy which blocks stop or start being evictable
  (`pin`/`unpin`, the policy's evictable notices).

`table_of(policy)` gives the table a tier uses. Both are held to the same answers and side
effects by tests/policies/test_lru_batch.py and tests/test_manager_bulk.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import filterfalse
from typing import Any, Protocol, cast

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus


class BlockTable(Protocol):
    """Per tier: which keys are resident, in which slot, in which state (see the module)."""

    def readable_run(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading `keys` are resident and readable (`ref_cnt >= 0`)."""

    def absent(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The `keys` not resident, in order."""

    def insert_written(self, keys: Sequence[OffloadKey], block_ids: Sequence[int],
                       tail: OffloadKey | None = None) -> None:
        """Add new blocks being written (`ref_cnt == -1`) in slots `block_ids`; `tail`: which of
        `keys` ends a request (see `CachePolicy.insert_many`)."""

    def pin_loads(self, keys: Sequence[OffloadKey]) -> list[int] | None:
        """When every key is resident and readable, pin each once more for reading (a key given
        twice: twice) and return their slots in order; otherwise change nothing, return None."""

    def release_loads(self, keys: Sequence[OffloadKey]) -> None:
        """Undo `pin_loads(keys)`; KeyError (nothing changed) if a key is not resident."""

    def mark_written(self, keys: Sequence[OffloadKey]) -> bool:
        """When every key is resident, being written and given once, make them readable and
        return True; otherwise change nothing and return False."""

    def evict_ids(self, n: int, protected: set[OffloadKey]) -> tuple[list[OffloadKey], list[int]] | None:
        """Evict exactly `n` readable, unpinned blocks not in `protected` (the policy picks
        them); their keys and slots, or None (nothing changed) when there are fewer."""


class PolicyTable:
    """The pure-Python `BlockTable` over `policy`'s own blocks (`get`), telling the policy of
    every block that stops being evictable (`pin`) or becomes evictable again (`unpin`)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def readable_run(self, keys: Sequence[OffloadKey]) -> int:
        get = self.policy.get
        for n, key in enumerate(keys):
            block = get(key)
            if block is None or block.ref_cnt < 0:
                return n
        return len(keys)

    def absent(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        return list(filterfalse(self.policy.get, keys))  # (a block, object or view, is truthy)

    def insert_written(self, keys: Sequence[OffloadKey], block_ids: Sequence[int],
                       tail: OffloadKey | None = None) -> None:
        if len(block_ids) != len(keys):
            raise ValueError(f"insert_written: {len(keys)} keys but {len(block_ids)} block ids")
        self.policy.insert_many(keys, BlockStatus.many(block_ids), tail=tail)
        self.policy.pin(keys)

    def pin_loads(self, keys: Sequence[OffloadKey]) -> list[int] | None:
        blocks = list(map(self.policy.get, keys))
        if not all(block is not None and block.ref_cnt >= 0 for block in blocks):
            return None
        for block in cast("list[BlockStatus]", blocks):
            block.ref_cnt += 1
        self.policy.pin(keys)
        return [cast("BlockStatus", block).block_id for block in blocks]

    def release_loads(self, keys: Sequence[OffloadKey]) -> None:
        blocks = list(map(self.policy.get, keys))
        if None in blocks:
            raise KeyError(keys[blocks.index(None)])
        released = []
        for key, block in zip(keys, cast("list[BlockStatus]", blocks)):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(key)
        self.policy.unpin(released)

    def mark_written(self, keys: Sequence[OffloadKey]) -> bool:
        blocks = list(map(self.policy.get, keys))
        for i, block in enumerate(blocks):
            if block is None or block.ref_cnt != -1:  # (a key given twice: 0 at its second place)
                for earlier in cast("list[BlockStatus]", blocks[:i]):
                    earlier.ref_cnt = -1
                return False
            block.ref_cnt = 0
        self.policy.unpin(keys)
        return True

    def evict_ids(self, n: int, protected: set[OffloadKey]) -> tuple[list[OffloadKey], list[int]] | None:
        victims = self.policy.evict(n, protected)
        if victims is None:
            return None
        return [key for key, _ in victims], [block.block_id for _, block in victims]

    def __repr__(self) -> str:
        return f"PolicyTable({self.policy!r})"


def table_of(policy: Any) -> BlockTable:
    """The block table of a tier whose policy is `policy`: the policy itself when its compiled
    index answers the batch calls (`batch_calls`), else a `PolicyTable` over it."""
    return cast(BlockTable, policy) if getattr(policy, "batch_calls", False) else PolicyTable(policy)
