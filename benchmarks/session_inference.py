"""What recognising sessions without hints could buy (issue 40): an upper bound, measured.

A recogniser would tell a session's turns apart from its prefix chain and arrival times, then
either keep a live session's blocks (retention) or let an idle one's blocks go first (an end
inferred from idle time). This study grants it more than any recogniser has: every request's true
session, from the session's second turn on (the first turn of a session looks like a one-time
request). On the generated session workloads of `kvtier bench trace`, in the same run:

- `prefix-freq`: no hints (the default);
- `vllm best`: the better of vLLM's LRU and ARC;
- `hints`: the client's hints (`kvtier bench trace --hints on`: session, retain_s, ends, one-shots);
- `kept`: oracle sessions retained `retain_s` after each turn (no ends);
- `idle ends`: the same, and a session idle for `retain_s` (or twice that) counts as ended: its
  stored blocks go first (`Retention.ends_on_expiry`).

    python -m benchmarks.session_inference [--workloads agentic,chat,mixed-scans]
        [--capacities 500,1000,2000] [--json FILE]

Prints a table and writes JSON (with provenance). The result (docs/bench.md): the best use of the
oracle beats `prefix-freq` by at most 0.0024 and loses up to 0.009 (ends inferred from idle time:
up to 0.025, agentic), so kvtier does not guess sessions: without hints, `prefix-freq` already
keeps chains together (cut from the deep end) and lets idle ones age out.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvtier import load_config_text
from kvtier.bench.provenance import provenance
from kvtier.bench.replay import replay_kvtier, replay_manager, replay_vllm
from kvtier.bench.sessions import SessionHints, SessionTrace, generate_session_trace
from kvtier.control.hierarchy import build_hierarchy
from kvtier.control.hints import HINTS_KEY

COLUMNS = ("prefix-freq", "vllm best", "hints", "kept", "idle ends", "idle ends 2x")


class OracleSessions(SessionHints):
    """Each request of a session seen before carries its true session and `retain_s`; nothing
    else (no ends, no one-shot hints): what a perfect recogniser knows from a second turn on."""

    def __init__(self, trace: SessionTrace, retain_s: float) -> None:
        super().__init__(trace, retain_s, one_shot=False)
        self.seen: set[str] = set()

    def context(self, req_id: str) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        i = int(req_id)
        self.now = self.trace.arrivals[i]
        session = self.trace.sessions[i]
        if session is None or session not in self.seen:
            if session is not None:
                self.seen.add(session)
            return ReqContext(req_id)
        return ReqContext(req_id, kv_transfer_params={HINTS_KEY: {"session": session, "retain_s": self.retain_s}})


def config(capacity: int) -> Any:
    """One CPU tier of `capacity` blocks with prefix-freq (replays move no bytes)."""
    return load_config_text(f"block_bytes: 4KiB\ntiers:\n  - {{name: cpu, backend: cpu, capacity: {capacity} blocks, "
                            "policy: prefix-freq}\n")


def oracle_hit_rate(trace: SessionTrace, capacity: int, retain_s: float, ends_on_expiry: bool) -> float:
    """prefix-freq replayed with `OracleSessions` (and idle sessions ended when `ends_on_expiry`)."""
    hierarchy = build_hierarchy(config(capacity), dry_run=True)
    try:
        hints = OracleSessions(trace, retain_s)
        retention = hierarchy.manager.retention
        retention.clock, retention.ends_on_expiry = hints.clock, ends_on_expiry
        return float(replay_manager(hierarchy.manager, trace, context_factory=hints.context)["hit_rate"])
    finally:
        hierarchy.close()


def row(trace: SessionTrace, capacity: int) -> dict[str, float]:
    """The hit rates of `COLUMNS` at `capacity` first-tier blocks."""
    retain = trace.retain_s()
    plain = replay_kvtier(config(capacity), trace)["hit_rate"]
    hinted = replay_kvtier(config(capacity), trace, hints=SessionHints(trace, retain))["hit_rate"]
    best = max(replay_vllm(capacity, policy, trace)["hit_rate"] for policy in ("lru", "arc"))
    return dict(zip(COLUMNS, (plain, best, hinted, oracle_hit_rate(trace, capacity, retain, False),
                              oracle_hit_rate(trace, capacity, retain, True),
                              oracle_hit_rate(trace, capacity, 2 * retain, True))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="agentic,chat,mixed-scans")
    parser.add_argument("--capacities", default="500,1000,2000")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",")]
    rows = []
    print(f"{'workload':12s} {'blocks':>6s} " + " ".join(f"{c:>12s}" for c in COLUMNS) + "  best oracle - prefix-freq")
    for workload in args.workloads.split(","):
        trace = generate_session_trace(workload)
        for capacity in capacities:
            rates = row(trace, capacity)
            gain = max(rates["kept"], rates["idle ends"], rates["idle ends 2x"]) - rates["prefix-freq"]
            rows.append({"workload": workload, "capacity_blocks": capacity, "retain_s": trace.retain_s(),
                         "hit_rate": rates, "best_oracle_gain": gain})
            print(f"{workload:12s} {capacity:6d} " + " ".join(f"{rates[c]:12.4f}" for c in COLUMNS) + f"  {gain:+.4f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**provenance(), "study": "session_inference", "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
