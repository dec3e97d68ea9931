"""`CachePolicy`: decides which blocks leave a tier. Pure Python; knows nothing of bytes or slots."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

from kvtier.keys import OffloadKey
from kvtier.types import BlockStatus


class CachePolicy(ABC):
    """Block organisation plus replacement decisions for one tier.

    Contract (every implementation runs `tests/policies/test_conformance.py`):
    - `get` finds a resident block, `insert` adds a newly allocated one, `remove` drops one
      (after a failed store), `touch` marks blocks as recently used (the first key of a prefix
      ends up the most recent, so a prefix is evicted tail first).
    - `evict(n, protected)` removes exactly `n` blocks whose `ref_cnt == 0` and whose key is not in
      `protected`, and returns them; if it cannot, it returns None and changes nothing.
    - `victim_candidates()` yields the evictable blocks in the order `evict` would take them now,
      without changing anything; the manager uses it to write blocks to the next tier before
      they are evicted. Policies that cannot predict this may yield nothing.
    """

    def __init__(self, cache_capacity: int) -> None:
        if cache_capacity <= 0:
            raise ValueError(f"cache_capacity must be > 0 blocks, got {cache_capacity}")
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockStatus | None:
        """The resident block for `key`, or None."""

    @abstractmethod
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        """Add a newly allocated block (not resident before)."""

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    tail: OffloadKey | None = None) -> None:
        """`insert(keys[i], blocks[i])` for each i, in order. Policies override it with a bulk
        version where that is faster; without `tail` the result must equal the loop's.

        `tail` says which of `keys` is the last block of a request: the manager passes a
        request's new blocks tail first with `tail=keys[0]` (engine stores), and no tail for
        copies between tiers (demotions, promotions). A policy that treats request tails
        differently (`prefix-freq` evicts them first while they look one-time) uses it; every
        other policy accepts and ignores it."""
        insert = self.insert
        for key, block in zip(keys, blocks):
            insert(key, block)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a resident block without recording it as evicted."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark resident blocks as recently used; keys not resident are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Evict exactly `n` unpinned, unprotected blocks, or return None and change nothing."""

    def victim_candidates(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Evictable blocks in the order `evict` would choose them now (no state change)."""
        return iter(())

    @abstractmethod
    def clear(self) -> None:
        """Forget every block (and any history such as ghost lists)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks."""

    def keys(self) -> Iterable[OffloadKey]:
        """Resident keys, in no particular order."""
        raise NotImplementedError


def evictable(entries: Iterable[tuple[OffloadKey, BlockStatus]], protected: set[OffloadKey]):
    """Filter `(key, block)` pairs to those that may be evicted now."""
    for key, block in entries:
        if block.ref_cnt == 0 and key not in protected:
            yield key, block
