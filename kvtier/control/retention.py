"""`Retention`: per-session retention hints, kept as protection from eviction in every tier.

A request may name its session and ask that the session's blocks be kept a while after its last
turn (`Hint`: under vLLM in the request's `kv_transfer_params["kvtier"]`, in the standalone API as
`store(..., hints=...)`; `kvtier.control.hints`). Every block a turn of the session stores,
loads or touches joins the session, if some tier holds it (a block offered and not stored does
not; one that leaves every tier is forgotten: `absent`, `left`); until `retain_s` after the
session's last turn those blocks are *retained*: every
tier's block table holds them (`on_hold`, `BlockTable.hold`), so no eviction takes them, as none
takes the blocks a load is reading, and an eviction costs the same however many are retained.

Hints are untrusted input, so everything is bounded:
- `retain_s` at most `max_retain_s`, `priority` 0 to 9, a session id of at most 128 printable
  characters, an optional `tenant` likewise (`parse_hint` names the field that is wrong); a
  session name is its tenant's own (another tenant's session of that name is another session);
- retained blocks hold at most `share` of the first tier (the smallest); over it, the sessions
  of the tenant holding the most lose their retention first, lowest priority and oldest turn
  first, so one tenant cannot take the share from the others (a session that lost it is still
  tracked, and retained again from its next turn);
- at most `max_sessions` sessions are tracked (the oldest turn is forgotten first), remembering
  at most twice the first tier's capacity of stored blocks in all (the oldest forgotten first).
A request's cost grows at most with the logarithm of the sessions and tenants clients name
(amortised): expiry, giving way and forgetting do not visit the others (`kvtier.control.expiry`,
`kvtier.control.holders`).
Retained blocks are kept like pinned ones: a store waits for room ("no room yet") while the
other blocks are pinned, and only a store the tier could not take even with every pin released
evicts them (`kept_past`), so a retention never makes a store impossible. Without hints this
module costs nothing per call.

`session_ended: true` releases the session's blocks at once and makes the blocks the session
stored itself the first victims (`on_ended`, set by the manager: every tier holding them evicts
them before its policy's victims, the deep end of the session first), except those another live
session retains; the blocks it found stored (a shared system prompt) stay ordinary, and so does a
block any request uses again. A one-shot request is a session ended at its first turn.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Callable, Collection, Iterable, KeysView
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq, ne, not_
from typing import Any

from kvtier.control.expiry import Expiries
from kvtier.control.hints import Hint, RequestHints, session_name
from kvtier.control.holders import Holders
from kvtier.core.keys import OffloadKey

RETAINED_SHARE = 0.5  # of the first tier's capacity, the most that retained blocks may hold
MAX_SESSIONS = 10_000  # sessions tracked at once (their memory: docs/bench.md, "The memory of hints")


@dataclass
class _Session:
    tenant: str
    priority: int
    until: float  # monotonic time its retention ends
    turn: int = 0  # when its last turn came (`Retention`'s count of turns): `sessions` is in this order
    held: int = 0  # the blocks it retains now (0: displaced)
    # the blocks it claimed, in order; `Retention.retained` says which are still its own (`_own`)
    keys: list[OffloadKey] = field(default_factory=list)
    stored: dict[OffloadKey, None] = field(default_factory=dict)  # the blocks it stored, oldest first


@dataclass
class RetentionStats:
    """Counters (cumulative), reported by `Retention.report` (`stats()["engine"]["retention"]`,
    `vllm:kvtier_retention_*`)."""

    hints: int = 0  # turns that carried a valid hint (a vLLM request; a standalone store or load)
    hints_refused: int = 0  # hints refused as invalid, once per request (under vLLM: logged, the request served)
    expired: int = 0  # sessions whose retention ran out
    ended: int = 0  # sessions ended by a hint
    displaced: int = 0  # sessions that lost their retention to the share or the session limit
    kept_past: int = 0  # evictions that took retained blocks (no room could be made otherwise)
    evicted_ended: int = 0  # blocks of ended sessions evicted before the policy's victims

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Retention:
    """The sessions with a retention and their blocks (see the module docstring). `capacity`:
    the first tier's blocks (the share is of it); `clock`: seconds, monotonic."""

    def __init__(self, capacity: int, share: float = RETAINED_SHARE, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = max(1, int(capacity * share))
        self.stored_limit = 2 * capacity  # stored blocks remembered, all sessions together
        self._stored = 0
        self._remembering: OrderedDict[str, None] = OrderedDict()  # sessions with stored blocks, as `sessions`
        self.max_sessions = max_sessions
        self.clock = clock
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # tracked, least recent turn first
        self._expiries = Expiries(self.sessions)
        self._turns = 0
        self._holders = Holders(self.sessions)  # the sessions retaining blocks, and who gives way first
        self.retained: dict[OffloadKey, str] = {}  # key -> the session that holds it
        self.stats = RetentionStats()
        # A session whose retention runs out counts as ended (its stored blocks go first). Off:
        # ends inferred from idle time bought nothing over prefix-freq (benchmarks/session_inference.py).
        self.ends_on_expiry = False
        self._requests = RequestHints(self.stats)  # the hints of vLLM's requests, read once each
        self.by_tenant = self._holders.by_tenant  # tenant -> blocks its sessions retain (> 0; others absent)
        # Told the blocks of a session that ended (deep end first): the manager makes them first victims.
        self.on_ended: Callable[[list[OffloadKey]], None] = _ignore
        # Told the blocks that start and stop being retained: the manager holds them in every tier's table.
        self.on_hold: Callable[[list[OffloadKey]], None] = _ignore
        self.on_unhold: Callable[[list[OffloadKey]], None] = _ignore
        # Of some keys, those resident in no tier (the manager asks every tier; alone: none).
        self.absent: Callable[[list[OffloadKey]], list[OffloadKey]] = _none_absent
        # Retained keys that left a tier (the tiers append them): those gone from every tier
        # are forgotten before the next turn or eviction (`_settle`).
        self.left: list[OffloadKey] = []

    def note(self, hint: Hint | None, keys: Iterable[OffloadKey], stored: Collection[OffloadKey] = ()) -> None:
        """A turn of `hint`'s session stored or hit `keys` (a request's blocks, prefix first), of
        which it stored `stored` itself (new in the first tier); counted in `stats.hints`. Only
        keys resident in some tier join the session (`absent`: a key offered but not stored is
        not retained)."""
        if hint is not None:
            self.stats.hints += 1
            self._note(hint, keys, stored)

    def _note(self, hint: Hint, keys: Iterable[OffloadKey], stored: Collection[OffloadKey] = ()) -> None:
        """`note`, not counted (a vLLM request's calls: `hint_of` counts the request once)."""
        if self.left:
            self._settle()
        name = session_name(hint)
        if hint.ended or hint.retain_s <= 0:
            self._release(name, ended=hint.ended, last=stored)
            return
        sessions = self.sessions
        session = sessions.get(name)
        if session is None:
            session = sessions[name] = _Session(hint.tenant, hint.priority, float("inf"))
        else:
            sessions.move_to_end(name)
            if session.stored:
                self._remembering.move_to_end(name)
        session.priority = hint.priority
        self._turns = session.turn = self._turns + 1
        until = self.clock() + hint.retain_s
        earlier, session.until = until < session.until, until
        if earlier:  # (a new session, or a shorter retention: a turn that extends one costs nothing there)
            self._expiries.add(name, until)
        if stored:
            remembered = session.stored
            before = len(remembered)
            remembered.update(dict.fromkeys(stored))
            self._stored += len(remembered) - before
            if not before and remembered:
                self._remembering[name] = None
        keys = keys if keys.__class__ is list else list(keys)
        owners = list(map(self.retained.get, keys))  # (None: not retained; session names are not empty)
        if owners.count(name) != len(owners):  # (C loops: usually a turn's keys are all its own, or all new)
            self._claim(session, name, keys, owners)
        if session.held:
            self._holders.touch(name, session.tenant, session.priority)
        if len(self.retained) > self.budget or len(sessions) > self.max_sessions or \
                self._stored > self.stored_limit:
            self._bound()

    def _claim(self, session: _Session, name: str, keys: list[OffloadKey], owners: list[str | None]) -> None:
        """The `keys` not `name`'s (`owners`: each one's session, or None) become session
        `name`'s, taken from any other session."""
        if owners.count(None) == len(owners):
            claim = fresh = list(dict.fromkeys(keys))  # (a turn's new blocks: no other session loses any)
        else:
            claim = list(dict.fromkeys(compress(keys, map(ne, repeat(name), owners))))
            owners = list(map(self.retained.get, claim))
            fresh = list(compress(claim, map(not_, owners)))
            if len(fresh) < len(claim):
                for owner in dict.fromkeys(filter(None, owners)):  # (each once, in order)
                    self._lose(owner, owners.count(owner))
        if fresh:
            absent = self.absent(fresh)
            if absent:  # (offered, not stored: no room, skipped by the threshold, a failed write)
                fresh = [key for key in fresh if key not in absent]
                claim = [key for key in claim if key not in absent]
        self.retained.update(zip(claim, repeat(name)))
        session.keys += claim
        session.held += len(claim)
        self._holders.count(session.tenant, len(claim))
        if len(session.keys) > 2 * session.held + 64:  # (a log of claims since taken: compacted)
            session.keys = self._own(session, name)
        if fresh:
            self.on_hold(fresh)

    def _lose(self, name: str, count: int) -> None:
        """Session `name` retains `count` fewer blocks (taken by another session, or gone)."""
        session = self.sessions[name]
        session.held -= count
        self._holders.count(session.tenant, -count)
        if not session.held:
            session.keys = []
            self._holders.discard(name)

    def _settle(self) -> None:
        """Forget the retained blocks that left every tier (`left`, as the tiers report them: an
        eviction past the share, a failed write or read, a reset), so that they hold no share."""
        left = list(dict.fromkeys(self.left))
        self.left.clear()
        retained = self.retained
        owners = [retained.pop(key) for key in self.absent([key for key in left if key in retained])]
        for owner in dict.fromkeys(owners):
            self._lose(owner, owners.count(owner))

    def _own(self, session: _Session, name: str) -> list[OffloadKey]:
        """The blocks session `name` retains now, in the order it claimed them (C loops)."""
        keys = session.keys
        return list(dict.fromkeys(compress(keys, map(eq, repeat(name), map(self.retained.get, keys)))))

    def note_turn(self, req_context: Any, keys: Iterable[OffloadKey],
                  stored: Collection[OffloadKey] = ()) -> Hint | None:
        """`note` the hint `req_context` carries (`hint_of`; None: none) for `keys`; that hint."""
        hint = None if req_context is None else self.hint_of(req_context)
        if hint is not None:
            self._note(hint, keys, stored)
        return hint

    def hint_of(self, req_context: Any) -> Hint | None:
        """The hint `req_context` carries, or None (`RequestHints.of`: an invalid one is refused,
        counted and logged once per request, and the request served without it)."""
        return self._requests.of(req_context)

    def report(self) -> dict[str, Any]:
        """The counters, the sessions retained now and their blocks (`stats()["retention"]`)."""
        if self.left:
            self._settle()
        return {**self.stats.as_dict(), "sessions": len(self._holders), "retained_blocks": len(self.retained),
                "budget_blocks": self.budget}

    def retaining(self) -> list[str]:
        """The sessions whose blocks are retained now, least recent turn first, by the names
        their hints gave (each tenant's own: a name may come once per tenant)."""
        return [name.rpartition("\x1f")[2] for name in self._holders.order]

    def held(self) -> KeysView[OffloadKey]:
        """The keys retained now (expired sessions released first); empty without hints."""
        if self.left:
            self._settle()
        if self.sessions and self.clock() >= self._expiries.next():
            self._expire()
        return self.retained.keys()

    # ------------------------------------------------------------------ bounds
    def _expire(self) -> None:
        """Release the sessions whose retention ran out, least recent turn first."""
        sessions = self.sessions
        for name in sorted(self._expiries.due(self.clock()), key=lambda name: sessions[name].turn):
            self._release(name, ended=self.ends_on_expiry)
            self.stats.expired += 1

    def _bound(self) -> None:
        while len(self.sessions) > self.max_sessions:
            self._release(next(iter(self.sessions)))
            self.stats.displaced += 1
        while len(self.retained) > self.budget:
            name = self._holders.least_deserving(newest=next(reversed(self.sessions)))
            if name is None:  # one session past the share: its prefix is kept
                name = next(iter(self._holders.order))
                session = self.sessions[name]
                if session.held != len(session.keys):  # (its log holds blocks since taken, or twice)
                    session.keys = self._own(session, name)
                own = session.keys  # (each its own block once, in claim order: cut in place, O(excess))
                past = own[self.budget:]
                del own[self.budget:]
                _consume(map(self.retained.__delitem__, past), 0)
                session.held = len(own)
                self._holders.count(session.tenant, -len(past))
                self.on_unhold(past)
                break
            self._unretain(self.sessions[name], name)
            self.stats.displaced += 1
        if self._stored > self.stored_limit:
            self._forget_stored(self._stored - self.stored_limit)

    def _forget_stored(self, count: int) -> None:
        """Forget `count` remembered stored blocks: the oldest of the least recent turns (of the
        sessions remembering any: those that remember none are not visited)."""
        emptied = []
        for name in self._remembering:
            stored = self.sessions[name].stored
            while stored and count:
                del stored[next(iter(stored))]
                count -= 1
                self._stored -= 1
            if not stored:
                emptied.append(name)
            if not count:
                break
        _consume(map(self._remembering.__delitem__, emptied), 0)

    def _unretain(self, session: _Session, name: str) -> None:
        """`session` (`name`) retains none of its blocks any more (it stays tracked)."""
        released = self._own(session, name)
        _consume(map(self.retained.__delitem__, released), 0)
        self._holders.count(session.tenant, -session.held)
        session.held, session.keys = 0, []
        self._holders.discard(name)
        if released:
            self.on_unhold(released)

    def _release(self, name: str, ended: bool = False, last: Iterable[OffloadKey] = ()) -> None:
        """Forget session `name`; `ended` (with `last`, the blocks its last turn stored): the
        blocks it stored that no other session retains go to `on_ended`, deep end first."""
        session = self.sessions.pop(name, None)
        self._remembering.pop(name, None)
        stored: Iterable[OffloadKey] = ()
        if session is not None:
            self._unretain(session, name)
            stored = session.stored
            self._stored -= len(stored)
            self.stats.ended += ended
        if ended:
            retained = self.retained
            chain = [key for key in dict.fromkeys([*stored, *last]) if key not in retained]
            if chain:
                self.on_ended(chain[::-1])


def _none_absent(keys: list[OffloadKey]) -> list[OffloadKey]:
    """The default `absent`: a `Retention` outside a hierarchy takes every key as resident."""
    return []


def _ignore(keys: list[OffloadKey]) -> None:
    """The default `on_ended`, `on_hold` and `on_unhold`: a `Retention` outside a hierarchy tells no tier."""
