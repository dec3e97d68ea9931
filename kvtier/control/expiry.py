"""`Expiries`: when each session's retention runs out (`kvtier.control.retention`), kept so that
finding the sessions whose time has passed costs O(log n) per session found, not a scan of every
tracked session (up to `MAX_SESSIONS`; docs/bench.md, "The cost of many sessions").

A min-heap of (time, session) with one entry per session, refreshed lazily: a turn that extends a
session's retention changes nothing here; when the entry comes due, the session's current time is
read and the entry put back if it moved. Only a new session, or a turn that shortens a retention,
adds an entry. Entries of sessions gone (released, ended) are dropped when they come due, and the
heap is rebuilt when it holds more than twice as many entries as there are sessions, plus 64.
"""

from __future__ import annotations

from collections.abc import Mapping
from heapq import heapify, heappop, heappush, heapreplace
from typing import Protocol


class _Timed(Protocol):
    until: float  # monotonic time its retention ends


class Expiries:
    """The end times of `sessions` (the retention's own map, by name; see the module docstring).
    Not thread-safe: the retention's owner calls it."""

    def __init__(self, sessions: Mapping[str, _Timed]) -> None:
        self._sessions = sessions
        self._heap: list[tuple[float, str]] = []
        # A time at or before the earliest retention end (infinity when there is none): no session's
        # retention ends before it. An attribute, kept by `add` and `due`: the retention reads it every turn.
        self.first = float("inf")

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, name: str, until: float) -> None:
        """Session `name` is new, or its retention now ends earlier than before: at `until`."""
        heap = self._heap
        heappush(heap, (until, name))
        if len(heap) > 2 * len(self._sessions) + 64:
            self._heap = heap = [(session.until, name) for name, session in self._sessions.items()]
            heapify(heap)
        self.first = heap[0][0] if heap else float("inf")

    def due(self, now: float) -> list[str]:
        """The sessions whose retention has ended by `now`, each once, in no particular order.
        Entries whose session moved its end past `now` are put back at that time."""
        heap, sessions = self._heap, self._sessions
        found: dict[str, None] = {}
        while heap and heap[0][0] <= now:
            name = heap[0][1]
            session = sessions.get(name)
            if session is None or name in found:
                heappop(heap)
            elif session.until <= now:
                found[name] = None
                heappop(heap)
            else:
                heapreplace(heap, (session.until, name))
        self.first = heap[0][0] if heap else float("inf")
        return list(found)
