"""Session workloads for the replay: requests with a session, an arrival time and a tenant.

A `SessionTrace` is a `Trace` whose every request also carries `arrivals` (seconds from the
start, non-decreasing), `sessions` (the session id, or None for a one-time request), `tenants` and
`last_turn` (the request is its session's last turn). Each turn of a session re-sends the
session's whole context and extends it, so a session is a chain of prefix blocks.

- `generate_session_trace(name, seed)` builds one of `WORKLOADS` (deterministic for a seed):
  `agentic` (tool loops: many turns, short tool-call gaps), `chat` (human pauses: few turns,
  long gaps), `mixed-scans` (both kinds over several tenants, interleaved with one-time
  document scans that would flush an LRU).
- `load_session_trace(path)` reads a Mooncake trace with its `timestamp`s (ms) and *infers*
  the sessions: a request that contains, at the same position, the last full block of an
  earlier request (its last block unless `input_length` says that one is partial) continues that
  request's session (Mooncake's hash ids name whole prefixes); the last
  such request in the trace is the session's last turn (known only because the trace is read
  whole: a replay oracle, as a client's `session_ended` would be).
- `SessionHints` turns a trace into the per-request hints a client would send and the
  simulated clock the replay runs retention on (`kvtier.bench.replay.replay_kvtier`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.workloads import MOONCAKE_BLOCK_TOKENS, Trace, TraceError, load_trace
from kvtier.control.hints import HINTS_KEY, MAX_RETAIN_S
from kvtier.core.types import ReqContext

RETAIN_QUANTILE = 0.9  # `retain_s` "auto": this quantile of the trace's gaps between a session's turns


@dataclass
class SessionTrace(Trace):
    """A `Trace` whose requests carry a session, an arrival time, a tenant and a last-turn flag
    (lists parallel to `requests`). `sessions_from`: "generated" or "inferred"."""

    arrivals: list[float] = field(default_factory=list)
    sessions: list[str | None] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)
    last_turn: list[bool] = field(default_factory=list)
    sessions_from: str = "generated"

    def head(self, n: int) -> SessionTrace:
        """The first `n` requests (a session cut short has no last turn)."""
        return SessionTrace(self.name, self.requests[:n], self.block_tokens, self.arrivals[:n], self.sessions[:n],
                            self.tenants[:n], self.last_turn[:n], self.sessions_from)

    def gaps(self) -> list[float]:
        """Seconds between consecutive turns of the same session, in trace order."""
        last: dict[str, float] = {}
        out = []
        for session, t in zip(self.sessions, self.arrivals):
            if session is not None:
                if session in last:
                    out.append(t - last[session])
                last[session] = t
        return out

    def retain_s(self, quantile: float = RETAIN_QUANTILE) -> float:
        """A retention covering `quantile` of the gaps (whole seconds, at least 1, at most the
        hints' maximum); 0 when no session has two turns."""
        gaps = sorted(self.gaps())
        if not gaps:
            return 0.0
        value = gaps[min(len(gaps) - 1, int(quantile * len(gaps)))]
        return float(min(MAX_RETAIN_S, max(1, math.ceil(value))))


@dataclass(frozen=True)
class SessionKind:
    """How the sessions of one kind look: turns, the first turn's and each next turn's new
    blocks (inclusive ranges), and the gap before each next turn (log-normal, seconds)."""

    turns: tuple[int, int]
    first_blocks: tuple[int, int]
    turn_blocks: tuple[int, int]
    gap_median_s: float
    gap_sigma: float


@dataclass(frozen=True)
class Mix:
    """A workload: `sessions` of each kind, starting every `session_every_s` on average (Poisson)
    over `tenants` tenants, each with a system prompt of `system_blocks` that its sessions share;
    one-time requests every `one_time_every_s` (0: none) of `one_time_blocks` new blocks,
    after their tenant's system prompt unless `scans` (then nothing shared at all)."""

    kinds: tuple[tuple[SessionKind, int], ...]
    session_every_s: float
    tenants: int = 4
    system_blocks: int = 8
    one_time_every_s: float = 0.0
    one_time_blocks: tuple[int, int] = (4, 16)
    scans: bool = False


AGENT = SessionKind(turns=(20, 60), first_blocks=(8, 24), turn_blocks=(1, 4), gap_median_s=4.0, gap_sigma=0.8)
CHAT = SessionKind(turns=(2, 12), first_blocks=(2, 6), turn_blocks=(1, 3), gap_median_s=30.0, gap_sigma=1.0)
WORKLOADS: dict[str, Mix] = {
    "agentic": Mix(((AGENT, 60),), session_every_s=20.0, one_time_every_s=1.0),
    "chat": Mix(((CHAT, 600),), session_every_s=3.0, one_time_every_s=2.0, one_time_blocks=(2, 12)),
    "mixed-scans": Mix(((AGENT, 24), (CHAT, 240)), session_every_s=5.0, tenants=6, one_time_every_s=5.0,
                       one_time_blocks=(48, 160), scans=True),
}


def generate_session_trace(name: str, seed: int = 0, scale: float = 1.0) -> SessionTrace:
    """The workload `WORKLOADS[name]` with `scale` times its sessions (at least one of each
    kind); the same `seed` gives the same trace."""
    mix = WORKLOADS[name]
    rng = random.Random(seed)
    ids = iter(range(1, 1 << 62))
    systems = [[next(ids) for _ in range(mix.system_blocks)] for _ in range(mix.tenants)]
    events: list[tuple[float, int, list[int], str | None, int, bool]] = []
    start = 0.0
    kinds = [kind for kind, count in mix.kinds for _ in range(max(1, round(count * scale)))]
    rng.shuffle(kinds)
    for n, kind in enumerate(kinds):
        start += rng.expovariate(1 / mix.session_every_s)
        tenant = rng.randrange(mix.tenants)
        for t, blocks, last in _turns(kind, start, systems[tenant], ids, rng):
            events.append((t, len(events), blocks, f"t{tenant}/s{n}", tenant, last))
    if mix.one_time_every_s > 0:
        t = 0.0
        while True:
            t += rng.expovariate(1 / mix.one_time_every_s)
            if t >= start:
                break
            tenant = rng.randrange(mix.tenants)
            blocks = [] if mix.scans else list(systems[tenant])
            blocks += [next(ids) for _ in range(rng.randint(*mix.one_time_blocks))]
            events.append((t, len(events), blocks, None, tenant, False))
    events.sort(key=lambda e: (e[0], e[1]))
    return SessionTrace(f"sessions-{name}", [e[2] for e in events], arrivals=[e[0] for e in events],
                        sessions=[e[3] for e in events], tenants=[f"t{e[4]}" for e in events],
                        last_turn=[e[5] for e in events])


def _turns(kind: SessionKind, start: float, system: list[int], ids: Iterator[int],
           rng: random.Random) -> Iterator[tuple[float, list[int], bool]]:
    """A session's turns: (arrival, the blocks it sends, whether it is the last)."""
    context = list(system) + [next(ids) for _ in range(rng.randint(*kind.first_blocks))]
    turns = rng.randint(*kind.turns)
    t = start
    for turn in range(turns):
        if turn:
            t += rng.lognormvariate(math.log(kind.gap_median_s), kind.gap_sigma)
            context.extend(next(ids) for _ in range(rng.randint(*kind.turn_blocks)))
        yield t, list(context), turn == turns - 1


def load_session_trace(path: str | Path, limit: int | None = None,
                       block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> SessionTrace:
    """A Mooncake trace with its arrival times (`timestamp`, ms) and inferred sessions (see the
    module docstring); `block_tokens` (the replay's config's) tells a partial last block by
    `input_length`. Raises TraceError naming the line of a missing or bad timestamp."""
    trace = load_trace(path, limit, block_tokens)
    arrivals, partial = _arrivals(Path(path), len(trace.requests), trace.block_tokens)
    names: list[str] = []
    tips: dict[tuple[int, int], str] = {}  # (position, block) of a request's last full block -> its session
    seen: set[int] = set()
    last_index: dict[str, int] = {}
    for i, hashes in enumerate(trace.requests):
        session = next((tips[(p, hashes[p])] for p in range(len(hashes) - 1, -1, -1) if (p, hashes[p]) in tips),
                       None) or f"s{i}"
        tip = len(hashes) - 1 - partial[i]
        if tip >= 0 and hashes[tip] not in seen:  # a repeated block adds no tip: it would capture later requests
            tips[(tip, hashes[tip])] = session
        seen.update(hashes)
        names.append(session)
        last_index[session] = i
    sessions: list[str | None] = list(names)
    return SessionTrace(trace.name, trace.requests, trace.block_tokens, arrivals=arrivals, sessions=sessions,
                        tenants=[""] * len(names), last_turn=[last_index[s] == i for i, s in enumerate(names)],
                        sessions_from="inferred")


def _arrivals(path: Path, count: int, block_tokens: int) -> tuple[list[float], list[bool]]:
    """Each request's arrival (seconds) and whether its last block is partial (`input_length`
    not a multiple of `block_tokens`; False without `input_length`)."""
    out: list[float] = []
    partial: list[bool] = []
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, 1):
            if len(out) >= count:
                break
            if not raw.strip():
                continue
            record = json.loads(raw)
            stamp = record.get("timestamp")
            if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not 0 <= stamp < 1e15:
                raise TraceError(f"{path}:{lineno}: sessions need arrival times: expected 'timestamp' (ms, a "
                                 f"number from 0), got {str(stamp)[:40]!r}")
            if out and stamp / 1000 < out[-1]:
                raise TraceError(f"{path}:{lineno}: timestamps must not decrease ({stamp} after {out[-1] * 1000:g})")
            out.append(stamp / 1000)
            length = record.get("input_length")
            partial.append(type(length) is int and length % block_tokens != 0)
    return out, partial


class SessionHints:
    """The hints a client would send with each request of `trace` (session, `retain_s`, tenant,
    `session_ended` on a last turn; a one-time request: a session of one turn, ended at once,
    so that only the blocks it stores go first) and the simulated clock: `context`
    builds request `req_id`'s context and moves `clock()` to its arrival, so retention expires
    in trace time, not in the replay's wall time."""

    def __init__(self, trace: SessionTrace, retain_s: float, one_shot: bool = True) -> None:
        self.trace = trace
        self.retain_s = retain_s
        self.one_shot = one_shot  # False: one-time requests carry no hint
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def context(self, req_id: str) -> ReqContext:
        i = int(req_id)
        trace = self.trace
        self.now = trace.arrivals[i]
        session = trace.sessions[i]
        if session is None:
            if not self.one_shot:
                return ReqContext(req_id)
            hint: dict[str, Any] = {"session": f"one-shot/{i}", "tenant": trace.tenants[i], "session_ended": True}
            return ReqContext(req_id, kv_transfer_params={HINTS_KEY: hint})
        hint = {"session": session, "retain_s": self.retain_s, "tenant": trace.tenants[i]}
        if trace.last_turn[i]:
            hint["session_ended"] = True
        return ReqContext(req_id, kv_transfer_params={HINTS_KEY: hint})
