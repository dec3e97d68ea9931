"""What a policy has been told of its blocks' evictability, for the differential tests that
compare a pure policy with its compiled twin. Both twins' tables count pins themselves
(`policy.table`: `pinned_keys`, `evictable_count`); a policy without a table keeps the block
table's notices (`CachePolicy.evictable`) in `_pinned`, which is what is compared then."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvtier.core.keys import OffloadKey


def pinned_of(policy: Any) -> set[OffloadKey] | None:
    """The keys counted as not evictable (None before the first notice)."""
    if hasattr(policy, "table"):
        return policy.table.pinned_keys()
    return None if policy._pinned is None else set(policy._pinned)


def evictable_count_of(policy: Any, protected: Collection[OffloadKey] = ()) -> int | None:
    """How many resident blocks are evictable by the notices, not counting `protected` (None
    before the first notice)."""
    if hasattr(policy, "table"):
        return policy.table.evictable_count(protected)
    pinned = policy._pinned
    if pinned is None:
        return None
    return len(policy) - len(pinned) - sum(1 for k in protected if k not in pinned and policy.get(k) is not None)
