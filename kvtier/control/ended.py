"""The blocks of ended sessions (`kvtier.control.retention`): the first victims of every tier that
holds them (`Tier.first_victims`, evicted by `Cascade.evict_for` before the policy's victims)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.control.tier import Tier
from kvtier.core.keys import OffloadKey


def mark_ended(tiers: Sequence[Tier], keys: list[OffloadKey]) -> None:
    """`Retention.on_ended`: `keys` (an ended session's blocks, deep end first) become the first
    victims of every tier holding them, after those already there."""
    for tier in tiers:
        get = tier.table.get
        tier.first_victims.update(dict.fromkeys(k for k in keys if get(k) is not None))


def evictable_first(tier: Tier, keep: Collection[OffloadKey]) -> list[OffloadKey]:
    """`tier`'s first victims that could go now, in order: readable, unpinned, not in `keep`
    (whether each is safe to evict is the caller's question)."""
    readable = tier.readable
    return [k for k in tier.first_victims if k not in keep and (b := readable(k)) is not None and b.ref_cnt == 0]
