"""Pinned keys set aside by the pure `prefix-freq` order (the block table's evictable notices)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from heapq import heappush

from kvtier.core.keys import OffloadKey


class AsideBlocks:
    """Pinned or protected keys that an eviction's walk met, taken out of their segment so that
    later walks do not read them again: key -> (segment, sequence number, stamp) in `entries`.

    The unpinned ones are served first, from `freed[segment]` ((stamp, seq, key), a heap):
    every aside key was met before the rest of its segment, so it is older than all of it. A
    touched or evicted aside key is put back into its segment first (`unaside`). Heap entries
    go stale (the key was put back, or set aside again with a new seq) and are checked against
    `entries` when read. `segs` are the owner's, shared (never replaced).
    """

    __slots__ = ("counts", "entries", "freed", "segs", "seq")

    def __init__(self, segs: list[OrderedDict[OffloadKey, float]]) -> None:
        self.segs = segs
        self.entries: dict[OffloadKey, tuple[int, int, float]] = {}
        self.counts = [0] * len(segs)  # aside keys per segment
        self.freed: list[list[tuple[float, int, OffloadKey]]] = [[] for _ in segs]
        self.seq = 0

    def unaside(self, keys: Iterable[OffloadKey], restore: bool = True) -> None:
        """Keys that are touched, evicted or removed are no longer aside; with `restore` they go
        back into their segment (with their stamp), for the caller to move or delete them."""
        pop, counts, segs = self.entries.pop, self.counts, self.segs
        for key in keys:
            entry = pop(key, None)
            if entry is not None:
                counts[entry[0]] -= 1
                if restore:
                    segs[entry[0]][key] = entry[2]

    def unpin(self, keys: Iterable[OffloadKey], pinned: set[OffloadKey]) -> None:
        """`keys` are evictable again: out of `pinned`, and the aside ones queued in `freed`."""
        entries, freed = self.entries, self.freed
        for key in keys:
            pinned.discard(key)
            entry = entries.get(key)
            if entry is not None:
                index, seq, stamp = entry
                heappush(freed[index], (stamp, seq, key))

    def lane(self, index: int, pinned: set[OffloadKey] | None) -> Iterator[tuple[OffloadKey, float]]:
        """(key, stamp) of segment `index` in its order: its unpinned aside keys first."""
        if not self.freed[index]:
            return iter(self.segs[index].items())
        return self._lane_with_aside(index, pinned or set())

    def _lane_with_aside(self, index: int, pinned: set[OffloadKey]) -> Iterator[tuple[OffloadKey, float]]:
        entries = self.entries
        seen = set()
        for stamp, seq, key in sorted(self.freed[index]):
            if entries.get(key) == (index, seq, stamp) and key not in pinned and key not in seen:
                seen.add(key)
                yield key, stamp
        yield from self.segs[index].items()

    def set_aside(self, met: list[tuple[int, OffloadKey]], pinned: set[OffloadKey] | None) -> None:
        """Take the pinned and protected keys an eviction met ((segment, key)) out of their
        segments' order (`met` is only collected while pins are tracked: `pinned` is a set)."""
        assert pinned is not None
        entries, segs, freed, counts = self.entries, self.segs, self.freed, self.counts
        seq = self.seq
        for index, key in met:
            if key in entries:
                continue  # aside already (a freed key protected this time)
            stamp = segs[index].pop(key, None)
            if stamp is None:
                continue  # evicted
            entries[key] = (index, seq, stamp)
            counts[index] += 1
            if key not in pinned:  # protected this time, evictable
                heappush(freed[index], (stamp, seq, key))
            seq += 1
        self.seq = seq
        for index, heap in enumerate(freed):
            if len(heap) > 2 * counts[index] + 64:  # drop stale entries now and then
                freed[index] = [e for e in heap if entries.get(e[2]) == (index, e[1], e[0])]

    def clear(self) -> None:
        self.entries.clear()
        self.counts = [0] * len(self.segs)
        self.freed = [[] for _ in self.segs]
