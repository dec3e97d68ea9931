"""`prefix-freq`: `PurePrefixFreqCachePolicy`'s decisions with its data layout owned by compiled code,
when it is built.

`PrefixFreqCachePolicy` is the compiled index (kvtier/policies/_compact_prefix.pyx, built
by `pip install` with the C compiler there) completed into a `CachePolicy`. It makes exactly the
decisions of the pure-Python `PurePrefixFreqCachePolicy` (kvtier/policies/prefix_pure.py, where the design
is explained) — the same victims, ghosts, clock and hit-age mean, to the last bit — with about 95
bytes per resident block including the key instead of some 370, and its request-cycle calls
(its block table, `kvtier.index.BlockTable`) in C loops. Like the compiled `lru`, `get` returns views of state the
policy keeps (`returns_views`): a view's `ref_cnt` reads and writes the policy's arrays, the
objects given to `insert` are copied and not kept, and blocks are compared by `block_id`. Its
ghost list (evicted keys) is in C arrays too, about 75 bytes per ghost against ~145 for the pure
class's dict of bytes objects.

When the extension is not importable (no compiler at install time) the registered name
`prefix-freq` resolves to `FallbackPrefixFreqCachePolicy`, a plain `PurePrefixFreqCachePolicy`, and the
first policy built says so in the log. The same conformance suites run against both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.policies.base import CachePolicy
from kvtier.policies.compiled import CompiledIndex, CompiledPolicy, FallbackPolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy

INDEX = CompiledIndex("prefix-freq", "kvtier.policies._compact_prefix", "CompactPrefixPolicy",
                      "about 4x the memory per block and 3-4x the CPU")
COMPILED = INDEX.cls is not None
if TYPE_CHECKING or COMPILED:
    from kvtier.policies._compact_prefix import CompactPrefixPolicy


class FallbackPrefixFreqCachePolicy(FallbackPolicy, PurePrefixFreqCachePolicy):
    """`prefix-freq` without its compiled index: `PurePrefixFreqCachePolicy` itself."""

    index = INDEX


if COMPILED:
    class PrefixFreqCachePolicy(CompiledPolicy, CompactPrefixPolicy, CachePolicy):
        """`prefix-freq` over C arrays (see the module docstring)."""

        # The tuning, read by the compiled index when an instance is made (see prefix_pure.py).
        credits = PurePrefixFreqCachePolicy.credits
        tail_reuse_max = PurePrefixFreqCachePolicy.tail_reuse_max
        ghost_fraction = PurePrefixFreqCachePolicy.ghost_fraction
        max_ghost_limit = PurePrefixFreqCachePolicy.max_ghost_limit
        unit_rate = PurePrefixFreqCachePolicy.unit_rate
        demote_tail = PurePrefixFreqCachePolicy.demote_tail
else:
    class PrefixFreqCachePolicy(FallbackPrefixFreqCachePolicy):  # type: ignore[no-redef]
        """`prefix-freq` without its compiled index (see `FallbackPrefixFreqCachePolicy`)."""

        announces_fallback = True  # only the registered name logs, not tests that pick the fallback
