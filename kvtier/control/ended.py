"""What a session's retention (`kvtier.control.retention`) does in the tiers: the blocks of ended
sessions are the first victims of every tier that holds them (`Tier.first_victims`, evicted by
`Cascade.evict_for` before the policy's victims); retained blocks are held in every tier's block
table (`BlockTable.hold`: never a victim while held; a block entering a tier is held there by
`kvtier.control.tier.hold_entering`)."""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvtier.control.tier import Tier
from kvtier.core.keys import OffloadKey


def mark_ended(tiers: Sequence[Tier], keys: list[OffloadKey]) -> None:
    """`Retention.on_ended`: `keys` (an ended session's blocks, deep end first) become the first
    victims of every tier holding them, after those already there."""
    for tier in tiers:
        get = tier.table.get
        tier.first_victims.update(dict.fromkeys(k for k in keys if get(k) is not None))


def absent(tiers: Sequence[Tier], keys: list[OffloadKey]) -> list[OffloadKey]:
    """`Retention.absent`: those of `keys` that no tier holds, in order (`BlockTable.absent`)."""
    for tier in tiers:
        if not keys:
            break
        keys = tier.table.absent(keys)
    return keys


def hold(tiers: Sequence[Tier], keys: list[OffloadKey]) -> None:
    """`Retention.on_hold`: `keys` started being retained: held wherever they are resident."""
    for tier in tiers:
        tier.table.hold(keys)


def unhold(tiers: Sequence[Tier], keys: list[OffloadKey]) -> None:
    """`Retention.on_unhold`: `keys` stopped being retained: evictable again wherever resident."""
    for tier in tiers:
        tier.table.hold(keys, False)


def evictable_first(tier: Tier, keep: Container[OffloadKey], held: Container[OffloadKey],
                    limit: int) -> list[OffloadKey]:
    """The first `limit` of `tier`'s first victims that could go now, in order: readable,
    unpinned, in neither `keep` nor `held` (whether each is safe to evict is the caller's
    question). Stops at `limit`: a call costs the keys it passes over, not the whole list."""
    readable, found = tier.readable, []
    for key in tier.first_victims:
        if key in keep or key in held or (block := readable(key)) is None or block.ref_cnt:
            continue
        found.append(key)
        if len(found) == limit:
            break
    return found
