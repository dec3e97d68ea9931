"""What a session's retention (`kvtier.control.retention`) does in the tiers: the blocks of ended
sessions are the first victims of every tier that holds them (`Tier.first_victims`, evicted by
`Cascade.evict_for` before the policy's victims); retained blocks are held in every tier's block
table (`BlockTable.hold`: never a victim while held; a block entering a tier is held there by
`kvtier.control.tier.hold_entering`). `Remembered`: the blocks each session stored, so that its
end can make them first victims."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Mapping, Sequence
from typing import Protocol

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


class _Storer(Protocol):
    stored: dict[OffloadKey, None]  # the blocks it stored, oldest first


class Remembered:
    """The blocks the sessions of `sessions` (the retention's map, least recent turn first)
    stored, in each session's `stored`: at most `limit` in all, the oldest of the least recent
    turns forgotten first, visiting only the sessions that remember some. Not thread-safe."""

    def __init__(self, sessions: Mapping[str, _Storer], limit: int) -> None:
        self._sessions = sessions
        self.limit = limit
        self.count = 0  # remembered, all sessions together
        self._order: OrderedDict[str, None] = OrderedDict()  # the sessions remembering some, as `sessions`

    def add(self, name: str, stored: Collection[OffloadKey]) -> None:
        """Session `name` stored `stored`."""
        remembered = self._sessions[name].stored
        before = len(remembered)
        remembered.update(dict.fromkeys(stored))
        self.count += len(remembered) - before
        if not before and remembered:
            self._order[name] = None

    def turn(self, name: str) -> None:
        """Session `name` took a turn (it is the most recent now)."""
        if name in self._order:
            self._order.move_to_end(name)

    def forget(self, name: str) -> None:
        """Session `name` is forgotten (it stays in `sessions` until the caller removes it)."""
        if self._order.pop(name, 0) is None:  # (it remembered some)
            self.count -= len(self._sessions[name].stored)

    def trim(self) -> None:
        """Forget the oldest blocks of the least recent turns past `limit`."""
        count, emptied = self.count - self.limit, []
        for name in self._order:
            if count <= 0:
                break
            stored = self._sessions[name].stored
            while stored and count > 0:
                del stored[next(iter(stored))]
                count -= 1
                self.count -= 1
            if not stored:
                emptied.append(name)
        for name in emptied:
            del self._order[name]
