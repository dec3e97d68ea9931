"""Type stub of the compiled order of `lru` (kvtier/policies/_compact_lru.pyx), composed into a
`CompactTable` (kvtier/index/_table_api.pyi)."""

from collections.abc import Collection

from kvtier.core.keys import OffloadKey
from kvtier.index._table_api import CompactOrder

class LRUOrder(CompactOrder):
    def __init__(self) -> None: ...
    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]: ...
    def memory_bytes(self) -> int: ...
