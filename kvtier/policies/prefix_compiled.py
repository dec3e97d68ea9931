"""`prefix-freq`: `PurePrefixFreqCachePolicy`'s decisions with its data layout owned by compiled code,
when it is built.

`PrefixFreqCachePolicy` is a compiled block table composed with prefix-freq's compiled order
(`PrefixOrder`, kvtier/policies/_compact_prefix.pyx, built by `pip install` with the C compiler
there). It makes exactly the
decisions of the pure-Python `PurePrefixFreqCachePolicy` (kvtier/policies/prefix_pure.py, where the design
is explained) — the same victims, ghosts, clock and hit-age mean, to the last bit — with about 95
bytes per resident block including the key instead of some 450, and its request-cycle calls
(its block table, `kvtier.index.BlockTable`) in C loops. Like the compiled `lru`, `get` returns
views of the table's entries (`returns_views`): a view's `ref_cnt` reads and writes the table, the
objects given to `insert` are copied and not kept, and blocks are compared by `block_id`. Its
ghost list (evicted keys) is in C arrays too, about 75 bytes per ghost against ~145 for the pure
class's dict of bytes objects.

When the extension is not importable (no compiler at install time) the registered name
`prefix-freq` resolves to `FallbackPrefixFreqCachePolicy`, a plain `PurePrefixFreqCachePolicy`, and the
first policy built says so in the log. The same conformance suites run against both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.core.keys import OffloadKey
from kvtier.policies.base import CachePolicy
from kvtier.policies.compiled import CompiledIndex, CompiledPolicy, FallbackPolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy

INDEX = CompiledIndex("prefix-freq", "kvtier.policies._compact_prefix", "PrefixOrder",
                      "about 5x the memory per block and 3-4x the CPU")
COMPILED = INDEX.cls is not None
if TYPE_CHECKING or COMPILED:
    from kvtier.policies._compact_prefix import PrefixOrder


class FallbackPrefixFreqCachePolicy(FallbackPolicy, PurePrefixFreqCachePolicy):
    """`prefix-freq` without its compiled index: `PurePrefixFreqCachePolicy` itself."""

    index = INDEX


if COMPILED:
    class PrefixFreqCachePolicy(CompiledPolicy, CachePolicy):
        """`prefix-freq` over C arrays (see the module docstring); the pure class's inspection
        properties are the order's."""

        # The tuning, read by the compiled order when an instance is made (see prefix_pure.py).
        credits = PurePrefixFreqCachePolicy.credits
        tail_reuse_max = PurePrefixFreqCachePolicy.tail_reuse_max
        ghost_fraction = PurePrefixFreqCachePolicy.ghost_fraction
        max_ghost_limit = PurePrefixFreqCachePolicy.max_ghost_limit
        unit_rate = PurePrefixFreqCachePolicy.unit_rate
        demote_tail = PurePrefixFreqCachePolicy.demote_tail

        def make_order(self) -> Any:
            return PrefixOrder(type(self))

        @property
        def ghosts(self) -> dict[OffloadKey, int]:
            return self.order.ghosts

        @property
        def ghost_limit(self) -> int:
            return self.order.ghost_limit

        @ghost_limit.setter
        def ghost_limit(self, limit: int) -> None:
            self.order.ghost_limit = limit

        @property
        def clock(self) -> float:
            return self.order.clock

        @property
        def unit(self) -> float:
            return self.order.unit

        @property
        def tail_counts(self) -> list[int]:
            return self.order.tail_counts

        @tail_counts.setter
        def tail_counts(self, counts: list[int]) -> None:
            self.order.tail_counts = counts

        @property
        def aside(self) -> list[OffloadKey]:
            return self.order.aside
else:
    class PrefixFreqCachePolicy(FallbackPrefixFreqCachePolicy):  # type: ignore[no-redef]
        """`prefix-freq` without its compiled index (see `FallbackPrefixFreqCachePolicy`)."""

        announces_fallback = True  # only the registered name logs, not tests that pick the fallback
