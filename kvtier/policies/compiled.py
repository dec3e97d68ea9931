"""Loading a compiled eviction order (kvtier/policies/_compact_*.pyx), the one log line that says
when a registered policy runs its pure-Python fallback instead, and `CompiledPolicy`: a compiled
block table composed with a compiled order, answering vLLM's `CachePolicy` calls."""

from __future__ import annotations

import importlib
import logging
from typing import Any, ClassVar

from kvtier.core.keys import OffloadKey
from kvtier.core.limits import MAX_INDEX_BLOCKS, MAX_KEY_BYTES
from kvtier.core.types import BlockStatus
from kvtier.policies.base import OnTable

log = logging.getLogger("kvtier.policies")


class CompiledIndex:
    """The extension class `attr` of module `module`, or None (`error` says why) where it was
    not built. `fallback_built` logs, once per index, that policy `policy` runs pure Python."""

    def __init__(self, policy: str, module: str, attr: str, cost: str) -> None:
        self.policy, self.module, self.cost = policy, module, cost
        self.warned = False
        self.error: str | None = None
        try:
            self.cls: Any = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            self.cls = None
            self.error = f"{type(exc).__name__}: {exc}"

    def fallback_built(self) -> None:
        """A fallback instance of the registered policy was made: say so the first time."""
        if self.warned:
            return
        self.warned = True
        log.warning("%s: the compiled index %s is not built (%s); using the pure-Python fallback (the same "
                    "decisions, %s). Reinstall kvtier with a C compiler and Python headers present "
                    "(pip install -e .) to build it.", self.policy, self.module, self.error, self.cost)


class FallbackPolicy:
    """Base (first) of a registered policy's pure-Python fallback class. The class registered in
    the extension's place sets `announces_fallback`, so the first instance made under the
    registered name logs that `index` is not built; tests that make the fallback directly do not."""

    index: ClassVar[CompiledIndex]
    announces_fallback: ClassVar[bool] = False
    compiled: ClassVar[bool] = False

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)  # type: ignore[call-arg]  # the policy class after this one
        if type(self).announces_fallback:
            self.index.fallback_built()


class CompiledPolicy(OnTable):
    """Base (first, before `CachePolicy`) of a compiled policy: `table`, a compiled block table
    (`kvtier.index._table_api.CompactTable`) composed with `order`, the order `make_order` makes.
    The table holds the blocks and answers vLLM's calls (bound once, so a call runs no Python
    frame here); it is the tier's block table (`table_of`). `get` returns views (`returns_views`)."""

    returns_views = True
    batch_calls = True
    compiled: ClassVar[bool] = True
    max_blocks: int | None = MAX_INDEX_BLOCKS  # int32 entry numbers (MAX_ENTRIES, kvtier/index/_table.pxd)
    max_key_bytes: int | None = MAX_KEY_BYTES  # a uint16 key length (MAX_KEY, kvtier/index/_table.pxd)

    def __init__(self, cache_capacity: int) -> None:
        from kvtier.index._table_api import CompactTable
        from kvtier.policies.base import CachePolicy

        CachePolicy.__init__(self, cache_capacity)  # type: ignore[arg-type]
        self.order = self.make_order()
        table = self.table = CompactTable(cache_capacity, self.order)
        self.get = table.get  # type: ignore[method-assign]
        self.insert = table.insert  # type: ignore[method-assign]
        self.insert_many = table.insert_many  # type: ignore[method-assign]
        self.remove = table.remove  # type: ignore[method-assign]
        self.touch = table.touch  # type: ignore[method-assign]
        self.evict = table.evict  # type: ignore[method-assign]
        self.victims = table.victims  # type: ignore[method-assign]
        self.evictable = table.evictable  # type: ignore[method-assign]

    def make_order(self) -> Any:
        """The compiled order this policy's table is composed with."""
        raise NotImplementedError

    # These, and `OnTable`'s, are replaced per instance by the table's (see __init__).
    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.table.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.table.insert(key, block)

    def insert_many(self, keys: Any, blocks: Any, tail: OffloadKey | None = None) -> None:
        self.table.insert_many(keys, blocks, tail)

    def memory_bytes(self) -> int:
        """Bytes allocated now for the table's arrays and the order's own."""
        return self.table.memory_bytes() + self.order.memory_bytes()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)}/{self.cache_capacity} blocks)"  # type: ignore[attr-defined]
