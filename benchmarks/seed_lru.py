"""A replacement policy written to vLLM's seed `CachePolicy` contract alone, as a third party would.

It has only `__init__(cache_capacity)`, `get`, `insert`, `remove`, `touch` and `evict`: no
`keys`, `len`, `clear`, `insert_many` or `victims`, and no kvtier base class. kvtier must
accept it by its methods (`with_key_index` supplies the rest). Used by kvtier's own tests and by
`benchmarks.control_plane` as the seed-contract row. Standard library only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class SeedLRU:
    """Least recently used first; refuses (`None`) when fewer than `n` blocks are evictable."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity
        self.blocks: OrderedDict[Any, Any] = OrderedDict()

    def get(self, block_hash: Any) -> Any:
        return self.blocks.get(block_hash)

    def insert(self, block_hash: Any, block: Any) -> None:
        self.blocks[block_hash] = block

    def remove(self, block_hash: Any) -> None:
        self.blocks.pop(block_hash, None)

    def touch(self, block_hashes: Any) -> None:
        for block_hash in reversed(list(block_hashes)):
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)

    def evict(self, n: int, protected: Any) -> list[tuple[Any, Any]] | None:
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
