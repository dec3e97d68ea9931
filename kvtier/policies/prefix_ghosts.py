"""The ghost list of `prefix-freq`: recently evicted keys, so that a re-store counts as a hit."""

from __future__ import annotations

from itertools import islice

from kvtier.core.keys import OffloadKey


class GhostList:
    """Evicted key -> the segment it was evicted from, oldest first (as ARC's ghost lists,
    Megiddo & Modha FAST'03; keys only).

    Bounded: `trim` keeps the newest `limit` keys once there are 2x `limit` of them, so the
    list holds between 1x and 2x `limit` keys and costs one C-level copy per `limit` evictions.
    The owner writes `evicted` directly (bulk `update`, single stores) and looks keys up through
    `pop`, which is `evicted.pop` (one C call); `trim` replaces both.
    """

    __slots__ = ("evicted", "limit", "pop")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.evicted: dict[OffloadKey, int] = {}
        self.pop = self.evicted.pop

    def trim(self) -> None:
        """Drop all but the newest `limit` keys when there are at least 2x `limit`."""
        evicted, limit = self.evicted, self.limit
        if len(evicted) >= 2 * limit:
            self.evicted = dict(islice(evicted.items(), len(evicted) - limit, None)) if limit else {}
            self.pop = self.evicted.pop

    def clear(self) -> None:
        self.evicted.clear()
