"""`Holders`: the sessions retaining blocks (`kvtier.control.retention`), and which of them gives
its retention up first when retained blocks are over the share.

The rule: in the tenant holding the most blocks, the session of lowest priority, then of oldest
turn; never the session whose turn is being noted (`newest`); when the tenants holding the most
have no other session, the tenants holding the next most, and so on. Tenant names come from
clients, so the answer must not cost a visit of every tenant or session (docs/bench.md, "The cost
of many sessions"): each tenant's holding sessions sit in one ordered map per priority, and
the tenants in a heap keyed (-blocks held, priority, turn) by their best session, kept lazily:
a key that grew stale is recomputed when it reaches the top, so only a change that makes a
tenant *more* deserving of losing (more blocks, a new or lower-priority session) needs an entry,
added by the next choice (once per tenant however many turns changed it). The heap is rebuilt
when it holds more than twice as many entries as tenants, plus 64.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from heapq import heapify, heappop, heappush, heapreplace
from typing import Protocol

_Key = tuple[int, int, int, str]  # (-blocks held, priority, turn, tenant)


class _Session(Protocol):
    turn: int  # its last turn's number: larger is more recent


class Holders:
    """The holding sessions of `sessions` (the retention's map, by name). Not thread-safe."""

    def __init__(self, sessions: Mapping[str, _Session]) -> None:
        self._sessions = sessions
        # every holding session, least recent turn first, with the (tenant, priority) it is filed under
        self.order: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.by_tenant: dict[str, int] = {}  # tenant -> blocks its sessions retain (> 0; others absent)
        self._levels: dict[str, dict[int, OrderedDict[str, None]]] = {}  # tenant -> priority -> sessions
        self._heap: list[_Key] = []
        self._grown: set[str] = set()  # tenants whose entries may be too late in the heap (see `_push_grown`)

    def count(self, tenant: str, blocks: int) -> None:
        """`tenant`'s sessions retain `blocks` more (fewer, when negative); a tenant holding
        nothing is forgotten."""
        count = self.by_tenant.get(tenant, 0) + blocks
        if count <= 0:
            self.by_tenant.pop(tenant, None)
            self._grown.discard(tenant)  # (so that it holds only tenants holding blocks: names come from clients)
            return
        self.by_tenant[tenant] = count
        if blocks > 0:
            self._grown.add(tenant)

    def touch(self, name: str, tenant: str, priority: int) -> None:
        """Session `name` (of `tenant`, at `priority`) retains blocks after its latest turn."""
        level = (tenant, priority)
        order = self.order
        old = order.get(name)
        if old == level:
            order.move_to_end(name)
            self._levels[tenant][priority].move_to_end(name)
            return
        if old is not None:
            order.move_to_end(name)
            self._leave(name, old)
        order[name] = level
        self._levels.setdefault(tenant, {}).setdefault(priority, OrderedDict())[name] = None
        self._grown.add(tenant)

    def discard(self, name: str) -> None:
        """Session `name` retains nothing any more."""
        level = self.order.pop(name, None)
        if level is not None:
            self._leave(name, level)

    def least_deserving(self, newest: str) -> str | None:
        """The session to give up (the module docstring's rule), or None when no session but
        `newest` holds blocks."""
        if len(self.by_tenant) == 1:  # (one tenant: no heap needed; tenants left in `_grown` keep it right)
            best = self._best(next(iter(self.by_tenant)), skip=newest)
            return None if best is None else best[1]
        if self._grown:
            self._push_grown()
        heap, answer = self._heap, None
        parked: dict[str, _Key] = {}  # tenants whose best is `newest`: their entry, put back at the end
        fixed: set[str] = set()  # tenants given their true key in this call (any other entry is a duplicate)
        while heap:
            top = heap[0]
            tenant = top[3]
            count = self.by_tenant.get(tenant)
            best = None if count is None else self._best(tenant, skip=newest if tenant in parked else None)
            if count is None or best is None:
                heappop(heap)
                continue
            key = (-count, best[0], self._sessions[best[1]].turn, tenant)
            if key != top:
                if tenant in fixed:
                    heappop(heap)
                else:
                    fixed.add(tenant)
                    heapreplace(heap, key)
                continue
            if best[1] != newest:
                answer = best[1]
                break
            parked[tenant] = heappop(heap)  # (its key stays right for later calls: put back below)
            fixed.add(tenant)
            second = self._best(tenant, skip=newest)
            if second is not None:  # (its next best competes; a stale entry once the newest is back)
                heappush(heap, (-count, second[0], self._sessions[second[1]].turn, tenant))
        for entry in parked.values():
            heappush(heap, entry)
        return answer

    def _best(self, tenant: str, skip: str | None = None) -> tuple[int, str] | None:
        """(priority, name) of `tenant`'s holding session of lowest priority, then oldest turn,
        other than `skip`; None when it has none."""
        levels = self._levels.get(tenant)
        if not levels:
            return None
        for priority in sorted(levels):
            names = iter(levels[priority])
            name: str | None = next(names)
            if name == skip:
                name = next(names, None)
            if name is not None:
                return priority, name
        return None

    def _leave(self, name: str, level: tuple[str, int]) -> None:
        tenant, priority = level
        levels = self._levels[tenant]
        names = levels[priority]
        del names[name]
        if not names:
            del levels[priority]
            if not levels:
                del self._levels[tenant]

    def _push_grown(self) -> None:
        """An entry for each tenant that grew more deserving since the last choice, keyed at or
        before its true key ((0, 0) precedes any session's priority and turn), so that it is
        recomputed before any tenant it may now precede is chosen."""
        heap, counts = self._heap, self.by_tenant
        for tenant in self._grown:
            if tenant in counts:
                heappush(heap, (-counts[tenant], 0, 0, tenant))
        self._grown.clear()
        if len(heap) > 2 * len(counts) + 64:
            self._heap = [(-count, 0, 0, tenant) for tenant, count in counts.items()]
            heapify(self._heap)

    def __len__(self) -> int:
        return len(self.order)
