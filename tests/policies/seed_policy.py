"""Policies written to vLLM's seed `CachePolicy` contract only (`__init__`, `get`, `insert`,
`remove`, `touch`, `evict`): no `keys`, `len`, `clear`, `insert_many` or `victims`.
Importable as `seed_policy:SeedLRUPolicy` while tests/policies is on sys.path."""

from __future__ import annotations

from benchmarks.seed_lru import SeedLRU
from kvtier.policies.base import CachePolicy


class SeedLRUPolicy(CachePolicy):
    """LRU through kvtier's base class, implementing only the seed's abstract methods."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._lru = SeedLRU(cache_capacity)
        self.blocks = self._lru.blocks  # key -> block, least recently used first

    def get(self, block_hash):
        return self._lru.get(block_hash)

    def insert(self, block_hash, block) -> None:
        self._lru.insert(block_hash, block)

    def remove(self, block_hash) -> None:
        self._lru.remove(block_hash)

    def touch(self, block_hashes) -> None:
        self._lru.touch(block_hashes)

    def evict(self, n, protected):
        return self._lru.evict(n, protected)


# The same policy without kvtier's base class (as a subclass of vLLM's own `CachePolicy` would be):
# kvtier must accept it by its methods alone.
DuckSeedPolicy = SeedLRU
