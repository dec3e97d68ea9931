"""`lru`: LRU's decisions with its data layout owned by compiled code, when it is built.

`LRUCachePolicy` is a compiled block table composed with LRU's compiled order (`LRUOrder`,
kvtier/policies/_compact_lru.pyx; built by `pip install` with the C compiler there): about 85
bytes per resident block including the key, against some 460 for the pure-Python
`PureLRUCachePolicy` (its table's dict entry and block object, its order's entry, the key object;
RSS at 200k blocks, 2026-11-30; see docs/policies.md). Its
`get` returns views of the table's entries (`returns_views`): a view's `ref_cnt` reads and writes
the table, the objects given to `insert` are copied and not kept, and blocks are compared by
`block_id`. A view is valid while its block stays resident; the manager holds views only of
pinned blocks. The table is the tier's block table (`kvtier.index.BlockTable`), in C loops.

When the extension is not importable (no compiler at install time) the registered name `lru`
resolves to `FallbackLRUCachePolicy`, a plain `PureLRUCachePolicy` (the same decisions, more memory),
and the first policy built says so in the log. The same conformance suites run against both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.policies.base import CachePolicy
from kvtier.policies.compiled import CompiledIndex, CompiledPolicy, FallbackPolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy

INDEX = CompiledIndex("lru", "kvtier.policies._compact_lru", "LRUOrder", "about 5x the memory per block")
COMPILED = INDEX.cls is not None
if TYPE_CHECKING or COMPILED:
    from kvtier.policies._compact_lru import LRUOrder


class FallbackLRUCachePolicy(FallbackPolicy, PureLRUCachePolicy):
    """`lru` without its compiled index: `PureLRUCachePolicy` itself (the same decisions)."""

    index = INDEX


if COMPILED:
    class LRUCachePolicy(CompiledPolicy, CachePolicy):
        """LRU over C arrays (see the module docstring)."""

        def make_order(self) -> Any:
            return LRUOrder()
else:
    class LRUCachePolicy(FallbackLRUCachePolicy):  # type: ignore[no-redef]
        """`lru` without its compiled index (see `FallbackLRUCachePolicy`)."""

        announces_fallback = True  # only the registered name logs, not tests that pick the fallback
