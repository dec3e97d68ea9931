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

`Claims`: which sessions retain each block and which blocks each session retains. A block several
sessions use (a shared system prompt) is retained while any of them retains it: `retained` names
one of them per block (the tiers ask only whether a block is there), `_also` the others, for the
blocks more than one session retains only. Every step costs the blocks it is given, never the
sessions sharing them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Callable, Iterable, Mapping
from heapq import heapify, heappop, heappush, heapreplace
from itertools import compress, filterfalse, repeat
from operator import not_
from typing import Protocol

from kvtier.core.keys import OffloadKey

_Key = tuple[int, int, int, str]  # (-blocks held, priority, turn, tenant)


class _Session(Protocol):
    turn: int  # its last turn's number: larger is more recent


class _Owner(Protocol):
    keys: dict[OffloadKey, None]  # the blocks it retains, in the order it claimed them


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


class Claims:
    """The blocks sessions retain (see the module docstring); `sessions`: the retention's map, by
    name, each session's `keys` the blocks it retains (kept here). Not thread-safe."""

    def __init__(self, sessions: Mapping[str, _Owner]) -> None:
        self._sessions = sessions
        self.retained: dict[OffloadKey, str] = {}  # key -> a session retaining it
        self._also: dict[OffloadKey, set[str]] = {}  # key -> the other sessions retaining it (none: absent)
        self.links = 0  # the blocks each session retains, summed over the sessions (a shared one counts each time)

    def claim(self, name: str, own: dict[OffloadKey, None], keys: list[OffloadKey],
              absent: Callable[[list[OffloadKey]], list[OffloadKey]]) -> tuple[int, list[OffloadKey]]:
        """Session `name` (retaining `own`) retains `keys` too, those some tier holds (`absent`
        names those none does; asked only of blocks no session retains). Returns how many it
        did not retain before, and those of them no session retained (to be held)."""
        retained = self.retained
        new = list(dict.fromkeys(filterfalse(own.__contains__, keys)))
        others = list(map(retained.get, new))
        if others.count(None) == len(others):  # (a turn's new blocks: usually no other session has them)
            fresh, shared = new, None
        else:
            fresh, shared = list(compress(new, map(not_, others))), list(compress(new, others))
        if fresh:
            gone = absent(fresh)
            if gone:  # (offered, not stored: no room, skipped by the threshold, a failed write)
                missing = set(gone)
                fresh = [key for key in fresh if key not in missing]
                new = [key for key in new if key not in missing]
            retained.update(zip(fresh, repeat(name)))
        if shared:
            also = self._also
            get = also.get
            for key in shared:  # (a Python loop: as fast as C ones at a turn's sizes, and one pass)
                holders = get(key)
                if holders is None:
                    also[key] = {name}
                else:
                    holders.add(name)
        own.update(dict.fromkeys(new))
        self.links += len(new)
        return len(new), fresh

    def let_go(self, name: str, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Session `name` retains `keys` (some of its own, taken out of its `keys` by the caller)
        no more; returns those no other session retains (released)."""
        retained, also = self.retained, self._also
        self.links -= len(keys)
        if not also:  # (no block is shared: all of them go)
            _consume(map(retained.__delitem__, keys), 0)
            return keys
        released = []
        get = also.get
        for key in keys:
            others = get(key)
            if others is None:
                released.append(key)
                del retained[key]
                continue
            if retained[key] == name:  # (another session retains it: hand it over, or just leave)
                retained[key] = others.pop()
            else:
                others.discard(name)
            if not others:
                del also[key]
        return released

    def drop(self, keys: Iterable[OffloadKey]) -> list[str]:
        """`keys` left every tier: no session retains them any more. Returns the sessions that
        retained them, once per block each retained."""
        retained, also, sessions = self.retained, self._also, self._sessions
        lost: list[str] = []
        for key in keys:
            name = retained.pop(key, None)
            if name is None:
                continue
            names = [name, *also.pop(key, ())]
            for name in names:
                del sessions[name].keys[key]
            lost += names
        self.links -= len(lost)
        return lost
