"""The cost of a hinted request as the sessions and tenants clients name grow (issue 40: the
control plane's cost must not depend on them; `MAX_SESSIONS` tracks up to 10,000).

    python -m benchmarks.retention_scale [--sessions 100,1000,10000] [--requests 20000] [--json FILE]

For each count, that many sessions take turns in random order, one request every 10 ms of a
simulated clock, in three cases (`CASES`):
- `expiry`: turns of one new block retained 30 to 60 s, one tenant, a first tier large enough
  that retained blocks stay under the share: sessions keep running out and coming back;
- `tenants`: each session names its own tenant, retains 600 s, and turns of 4 blocks fill the
  share of a 40,000-block first tier, so a session gives way on most turns;
- `forget`: one tenant, turns that store 4 blocks each into a 1,000-block first tier, so the
  stored blocks remembered (at most 2,000) are forgotten on most turns.
Reported per request: the CPU time of the retention's `note` and `held` (the calls a request's
store makes), and the sessions tracked, expired and displaced in the run. Last (`alone`), one
session alone past the share of a first tier of 1,000 / 10,000 / 100,000 blocks, 4 new blocks a
turn (`--requests` turns): it keeps its prefix and lets its newest blocks go. This is a
benchmark, not a test: it prints rows and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from benchmarks.memory import hash_keys
from kvtier.bench.provenance import provenance
from kvtier.control.hints import Hint
from kvtier.control.retention import Retention

# case -> (blocks a turn, first-tier blocks (None: 100 per turn), retain_s range, tenant per session, turns store)
CASES: dict[str, tuple[int, int | None, tuple[float, float], bool, bool]] = {
    "expiry": (1, None, (30.0, 60.0), False, False),
    "tenants": (4, 40_000, (600.0, 600.0), True, False),
    "forget": (4, 1_000, (600.0, 600.0), False, True),
}


def measure(case: str, sessions: int, requests: int) -> dict[str, Any]:
    """One run of `case` (see the module docstring)."""
    blocks, capacity, (low, high), own_tenant, storing = CASES[case]
    now = [0.0]
    retention = Retention(capacity=capacity or 100 * (sessions + requests), clock=lambda: now[0])
    rng = random.Random(1)
    names = [f"session-{i}" for i in range(sessions)]
    keys = hash_keys(0, blocks * (sessions + requests))

    def turn(i: int, name: str, retain_s: float) -> None:
        now[0] += 0.01
        turn_keys = keys[blocks * i:blocks * (i + 1)]
        retention.note(Hint(name, retain_s, tenant=name if own_tenant else ""), turn_keys,
                       stored=turn_keys if storing else ())
        retention.held()

    for i, name in enumerate(names):  # every session's first turn
        turn(i, name, rng.uniform(low, high))
    turns = [(rng.choice(names), rng.uniform(low, high)) for _ in range(requests)]
    start = time.process_time()
    for i, (name, retain_s) in enumerate(turns, sessions):
        turn(i, name, retain_s)
    cpu = time.process_time() - start
    stats = retention.stats
    return {"case": case, "sessions": sessions, "requests": requests, "us_per_request": cpu * 1e6 / requests,
            "tracked_at_end": len(retention.sessions), "expired": stats.expired, "displaced": stats.displaced}


def measure_alone(capacity: int, requests: int) -> dict[str, Any]:
    """One session alone past the share of a `capacity`-block first tier (module docstring)."""
    retention = Retention(capacity=capacity, clock=lambda: 0.0)
    first = capacity // 2 + 4  # (past the share from its first turn)
    keys = hash_keys(0, first + 4 * requests)
    retention.note(Hint("alone", 600.0), keys[:first])
    turns = [keys[i:i + 4] for i in range(first, len(keys), 4)]
    start = time.process_time()
    for turn in turns:
        retention.note(Hint("alone", 600.0), turn)
        retention.held()
    cpu = time.process_time() - start
    return {"case": "alone", "capacity_blocks": capacity, "requests": requests,
            "us_per_request": cpu * 1e6 / requests, "retained_blocks": len(retention.retained)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", default="100,1000,10000", help="session counts, comma-separated")
    parser.add_argument("--requests", type=int, default=20_000, help="timed requests per count")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    rows = [measure(case, int(count), args.requests) for case in CASES
            for count in args.sessions.split(",")]
    alone = [measure_alone(capacity, args.requests) for capacity in (1_000, 10_000, 100_000)]
    for row in rows:
        print(f"{row['case']:>7}, {row['sessions']:>6} sessions: {row['us_per_request']:7.1f} us per request "
              f"({row['tracked_at_end']} tracked at the end, {row['expired']} expired, {row['displaced']} displaced)")
    for row in alone:
        print(f"  alone, {row['capacity_blocks']:>6}-block tier: {row['us_per_request']:7.1f} us per request "
              f"({row['retained_blocks']} retained)")
    if args.json:
        with open(args.json, "w") as out_file:
            json.dump({**provenance(), "rows": rows + alone}, out_file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
