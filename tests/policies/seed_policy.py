"""Policies written to vLLM's seed `CachePolicy` contract only (`__init__`, `get`, `insert`,
`remove`, `touch`, `evict`): no `keys`, `len`, `clear`, `insert_many` or `victim_candidates`.
Importable as `seed_policy:SeedLRUPolicy` while tests/policies is on sys.path."""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import CachePolicy


class SeedLRUPolicy(CachePolicy):
    """LRU through kvtier's base class, implementing only the seed's abstract methods."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: OrderedDict = OrderedDict()

    def get(self, block_hash):
        return self.blocks.get(block_hash)

    def insert(self, block_hash, block) -> None:
        self.blocks[block_hash] = block

    def remove(self, block_hash) -> None:
        self.blocks.pop(block_hash, None)

    def touch(self, block_hashes) -> None:
        for block_hash in reversed(list(block_hashes)):
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)

    def evict(self, n, protected):
        if n <= 0:
            return []
        chosen = []
        for block_hash, block in self.blocks.items():
            if block.ref_cnt == 0 and block_hash not in protected:
                chosen.append((block_hash, block))
                if len(chosen) == n:
                    break
        if len(chosen) < n:
            return None
        for block_hash, _ in chosen:
            del self.blocks[block_hash]
        return chosen


class DuckSeedPolicy:
    """The same policy without kvtier's base class (as a subclass of vLLM's own `CachePolicy`
    would be): kvtier must accept it by its methods alone."""

    def __init__(self, cache_capacity: int) -> None:
        self._inner = SeedLRUPolicy(cache_capacity)

    def get(self, block_hash):
        return self._inner.get(block_hash)

    def insert(self, block_hash, block) -> None:
        self._inner.insert(block_hash, block)

    def remove(self, block_hash) -> None:
        self._inner.remove(block_hash)

    def touch(self, block_hashes) -> None:
        self._inner.touch(block_hashes)

    def evict(self, n, protected):
        return self._inner.evict(n, protected)
