"""`Retention`: per-session retention hints, kept as protection from eviction in every tier.

A request may name its session and ask that the session's blocks be kept a while after its last
turn (`Hint`: under vLLM in the request's `kv_transfer_params["kvtier"]`, in the standalone API as
`store(..., hints=...)`; `kvtier.control.hints`). Every block a turn of the session stores,
loads or touches joins the session, if some tier holds it (a block offered and not stored does
not; one that leaves every tier is forgotten by every session: `absent`, `left`); until
`retain_s` after the session's last turn those blocks are *retained*: every tier's block table
holds them (`on_hold`, `BlockTable.hold`), so no eviction takes them, as none takes the blocks a
load is reading, and an eviction costs the same however many are retained. A block several
sessions use (a shared system prompt) stays retained while any of them retains it: the end,
expiry or displacement of one releases only the blocks no other retains
(`kvtier.control.holders.Claims`).

Hints are untrusted input, so everything is bounded:
- `retain_s` at most `max_retain_s`, `priority` 0 to 9, a session id of at most 128 printable
  characters, an optional `tenant` likewise (`parse_hint` names the field that is wrong); a
  session name is its tenant's own (another tenant's session of that name is another session);
- retained blocks (each once, however many sessions retain it) hold at most `share` of the first
  tier (the smallest); over it, the sessions of the tenant holding the most lose their retention
  first, lowest priority and oldest turn first, so one tenant cannot take the share from the
  others (a session that lost it is still tracked, and retained again from its next turn). A
  tenant's count is of its sessions' blocks, a block once per session retaining it, and the
  sessions' blocks so counted (`Claims.links`) are at most `LINKS_PER_BLOCK` times the first
  tier, past which sessions give way by the same rule. The tenant is the unit of fairness and
  comes with the hint: it protects tenants from each other only when a trusted front end sets
  it (a client free to name tenants spreads its sessions over many names and takes the share);
- at most `max_sessions` sessions are tracked: a turn whose session retains no block and
  remembers none it stored leaves no session tracked (a client naming a new session per request
  of missing blocks costs nothing kept); over the limit, the sessions retaining nothing are
  forgotten first (longest idle first), then the oldest turn. At most twice the first tier's
  capacity of stored blocks are remembered in all (the oldest forgotten first).
A session whose retention ran out is released before the next turn, report or eviction looks
at the retained blocks (`held`, `report`, `retaining`). A request's cost grows with its own
blocks and at most with the logarithm of the sessions and tenants clients name (amortised):
expiry, giving way and forgetting do not visit the others, nor does a block shared by many
sessions cost a visit of each (`kvtier.control.expiry`, `kvtier.control.holders`).
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
from collections import Counter, OrderedDict
from collections import deque as _consume
from collections.abc import Callable, Collection, Iterable, KeysView
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from kvtier.control.ended import Remembered
from kvtier.control.expiry import Expiries
from kvtier.control.hints import Hint, RequestHints, session_name
from kvtier.control.holders import Claims, Holders
from kvtier.core.keys import OffloadKey

RETAINED_SHARE = 0.5  # of the first tier's capacity, the most that retained blocks may hold
MAX_SESSIONS = 10_000  # sessions tracked at once (their memory: docs/bench.md, "The memory of hints")
_ENDED_MEMO = 1024  # sessions remembered as ended lately (`Retention._count_ended`)
LINKS_PER_BLOCK = 4  # per first-tier block, the most blocks all sessions retain, each counted per session


@dataclass
class _Session:
    tenant: str
    priority: int
    until: float  # monotonic time its retention ends
    turn: int = 0  # when its last turn came (`Retention`'s count of turns): `sessions` is in this order
    keys: dict[OffloadKey, None] = field(default_factory=dict)  # the blocks it retains, in claim order (`Claims`)
    stored: dict[OffloadKey, None] = field(default_factory=dict)  # the blocks it stored, oldest first

    @property
    def held(self) -> int:
        """The blocks it retains now (0: displaced, or its blocks left every tier)."""
        return len(self.keys)


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
        self.link_limit = max(self.budget, LINKS_PER_BLOCK * capacity)  # (`Claims.links`)
        self.max_sessions = max_sessions
        self.clock = clock
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # tracked, least recent turn first
        self._idle: OrderedDict[str, None] = OrderedDict()  # tracked sessions retaining nothing, longest idle first
        # (session, request) ended lately (at most `_ENDED_MEMO`): the request's later calls end it again, counted once.
        self._ended: OrderedDict[tuple[str, Any], None] = OrderedDict()
        self._expiries = Expiries(self.sessions)
        self._turns = 0
        self._holders = Holders(self.sessions)  # the sessions retaining blocks, and who gives way first
        self._claims = Claims(self.sessions)  # which sessions retain each block
        self._stored = Remembered(self.sessions, 2 * capacity)  # the blocks they stored, for their ends
        self.retained = self._claims.retained  # key -> a session retaining it (the tiers ask it: `Tier.retained`)
        self.stats = RetentionStats()
        # A session whose retention runs out counts as ended (its stored blocks go first). Off:
        # ends inferred from idle time bought nothing over prefix-freq (benchmarks/session_inference.py).
        self.ends_on_expiry = False
        self._requests = RequestHints(self.stats)  # the hints of vLLM's requests, read once each
        # tenant -> blocks its sessions retain, a block once per session retaining it (> 0; others absent)
        self.by_tenant = self._holders.by_tenant
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

    def _note(self, hint: Hint, keys: Iterable[OffloadKey], stored: Collection[OffloadKey] = (),
              request: Any = None) -> None:
        """`note`, not counted (a vLLM request's calls: `hint_of` counts the request once);
        `request`: the id of the request whose call this is (None: a call of its own)."""
        if self.left:
            self._settle()
        now = self.clock()
        if now >= self._expiries.first:  # (the heap's top: no session is visited unless one ran out)
            self._expire(now)
        name = session_name(hint)
        if hint.ended or hint.retain_s <= 0:
            self._release(name, ended=hint.ended, last=stored, request=request)
            return
        sessions = self.sessions
        session = sessions.get(name)
        if session is None:
            session = sessions[name] = _Session(hint.tenant, hint.priority, float("inf"))
        else:
            sessions.move_to_end(name)
            if session.stored:
                self._stored.turn(name)
        session.priority = hint.priority
        self._turns = session.turn = self._turns + 1
        if stored:
            self._stored.add(name, stored)
        keys = keys if keys.__class__ is list else list(keys)
        own = session.keys
        if not all(map(own.__contains__, keys)):  # (a C loop: usually a turn's keys are all its own)
            added, fresh = self._claims.claim(name, own, keys, self.absent)  # (those some tier holds)
            if added:
                self._holders.count(session.tenant, added)
                if self._idle:
                    self._idle.pop(name, None)
            if fresh:
                self.on_hold(fresh)
        if own:
            self._holders.touch(name, session.tenant, session.priority)
        elif not self._keep_idle(name, session):
            return
        until = now + hint.retain_s
        earlier, session.until = until < session.until, until
        if earlier:  # (a new session, or a shorter retention: a turn that extends one costs nothing there)
            self._expiries.add(name, until)
        if len(self.retained) > self.budget or len(sessions) > self.max_sessions or \
                self._stored.count > self._stored.limit or self._claims.links > self.link_limit:
            self._bound()

    def _keep_idle(self, name: str, session: _Session) -> bool:
        """Session `name`, retaining nothing after its turn, stays tracked (the most recently
        idle) if it remembers blocks it stored; else it is forgotten (False)."""
        if session.stored:
            self._idle[name] = None
            self._idle.move_to_end(name)
            return True
        del self.sessions[name]
        self._idle.pop(name, None)
        return False

    def _settle(self) -> None:
        """Forget the retained blocks that left every tier (`left`, as the tiers report them: an
        eviction past the share, a failed write or read, a reset), in every session retaining
        them, so that they hold no share."""
        left = list(dict.fromkeys(self.left))
        self.left.clear()
        retained = self.retained
        gone = [key for key in left if key in retained]
        lost = self._claims.drop(self.absent(gone)) if gone else ()
        for name, count in Counter(lost).items():  # (each session once)
            session = self.sessions[name]
            self._holders.count(session.tenant, -count)
            if not session.keys:
                self._holders.discard(name)
                self._idle[name] = None

    def note_turn(self, req_context: Any, keys: Iterable[OffloadKey],
                  stored: Collection[OffloadKey] = ()) -> Hint | None:
        """`note` the hint `req_context` carries (`hint_of`; None: none) for `keys`; that hint."""
        hint = None if req_context is None else self.hint_of(req_context)
        if hint is not None:
            self._note(hint, keys, stored, getattr(req_context, "req_id", None))
        return hint

    def hint_of(self, req_context: Any) -> Hint | None:
        """The hint `req_context` carries, or None (`RequestHints.of`: an invalid one is refused,
        counted and logged once per request, and the request served without it)."""
        return self._requests.of(req_context)

    def report(self) -> dict[str, Any]:
        """The counters, the sessions retained now and their blocks (`stats()["retention"]`)."""
        self._catch_up()
        return {**self.stats.as_dict(), "sessions": len(self._holders), "retained_blocks": len(self.retained),
                "budget_blocks": self.budget}

    def retaining(self) -> list[str]:
        """The sessions whose blocks are retained now, least recent turn first, by the names
        their hints gave (each tenant's own: a name may come once per tenant)."""
        self._catch_up()
        return [name.rpartition("\x1f")[2] for name in self._holders.order]

    def held(self) -> KeysView[OffloadKey]:
        """The keys retained now (expired sessions released first); empty without hints."""
        self._catch_up()
        return self.retained.keys()

    # ------------------------------------------------------------------ bounds
    def _catch_up(self) -> None:
        """Forget the blocks that left every tier and release the sessions that ran out."""
        if self.left:
            self._settle()
        if self.sessions:
            now = self.clock()
            if now >= self._expiries.first:
                self._expire(now)

    def _expire(self, now: float) -> None:
        """Release the sessions whose retention ran out by `now`, least recent turn first."""
        sessions = self.sessions
        for name in sorted(self._expiries.due(now), key=lambda name: sessions[name].turn):
            self._release(name, ended=self.ends_on_expiry)
            self.stats.expired += 1

    def _bound(self) -> None:
        sessions = self.sessions
        while len(sessions) > self.max_sessions:  # (those retaining nothing first)
            oldest = next(iter(self._idle or sessions))
            self.stats.displaced += bool(sessions[oldest].keys)  # (one retaining nothing lost nothing)
            self._release(oldest)
        while len(self.retained) > self.budget or self._claims.links > self.link_limit:
            newest = next(reversed(sessions))
            name = self._holders.least_deserving(newest=newest)
            if name is None:  # one session past the share: its prefix is kept
                self._cut(newest)
                break
            self._unretain(sessions[name], name)
            self.stats.displaced += 1
        if self._stored.count > self._stored.limit:
            self._stored.trim()

    def _cut(self, name: str) -> None:
        """Session `name`, the only one retaining blocks, past the share: the blocks it claimed
        last go (O(excess): its keys are in claim order)."""
        session = self.sessions[name]
        own = session.keys
        past = list(islice(reversed(own), max(0, len(own) - self.budget)))
        if past:
            _consume(map(own.__delitem__, past), 0)
            released = self._claims.let_go(name, past)
            self._holders.count(session.tenant, -len(past))
            self.on_unhold(released)

    def _unretain(self, session: _Session, name: str) -> None:
        """`session` (`name`) retains none of its blocks any more (it stays tracked, idle);
        those no other session retains are released."""
        own = session.keys
        if not own:
            return
        session.keys = {}
        released = self._claims.let_go(name, list(own))
        self._holders.count(session.tenant, -len(own))
        self._holders.discard(name)
        self._idle[name] = None
        if released:
            self.on_unhold(released)

    def _release(self, name: str, ended: bool = False, last: Iterable[OffloadKey] = (), request: Any = None) -> None:
        """Forget session `name`; `ended` (with `last`, the blocks its last turn stored): the
        blocks it stored that no other session retains go to `on_ended`, deep end first."""
        session = self.sessions.get(name)
        stored: Iterable[OffloadKey] = ()
        if session is not None:
            self._unretain(session, name)
            self._stored.forget(name)
            del self.sessions[name]
            self._idle.pop(name, None)
            stored = session.stored
        if ended:
            self._count_ended(name, session is not None, request)
            retained = self.retained
            chain = [key for key in dict.fromkeys([*stored, *last]) if key not in retained]
            if chain:
                self.on_ended(chain[::-1])

    def _count_ended(self, name: str, tracked: bool, request: Any) -> None:
        """Count session `name` ended, once: a tracked one always; one never tracked (ended at its
        first turn: a one-shot request) unless `request` ended it already (its later calls; None:
        a call of its own, counted)."""
        if tracked or request is None or (name, request) not in self._ended:
            self.stats.ended += 1
        if request is not None:
            ended = self._ended
            ended[(name, request)] = None
            if len(ended) > _ENDED_MEMO:
                ended.popitem(last=False)


def _none_absent(keys: list[OffloadKey]) -> list[OffloadKey]:
    """The default `absent`: a `Retention` outside a hierarchy takes every key as resident."""
    return []


def _ignore(keys: list[OffloadKey]) -> None:
    """The default `on_ended`, `on_hold` and `on_unhold`: a `Retention` outside a hierarchy tells no tier."""
