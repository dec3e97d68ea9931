"""The cost of a hinted request as the sessions tracked grow (issue 40: the control plane's cost
must not depend on how many sessions clients open; `MAX_SESSIONS` tracks up to 10,000).

    python -m benchmarks.retention_expiry [--sessions 100,1000,10000] [--requests 20000] [--json FILE]

For each count, that many sessions take turns in random order, one request every 10 ms of a
simulated clock, each turn one new block and a retention of 30 to 60 s, so sessions keep running
out and coming back. Reported per request: the CPU time of the retention's `note` and `held` (the
calls a request's store makes), and the sessions tracked and expired in the run. This is a
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
from kvtier.control.retention import Hint, Retention


def measure(sessions: int, requests: int) -> dict[str, Any]:
    """One run (see the module docstring): microseconds per request and the counts."""
    now = [0.0]
    retention = Retention(capacity=100 * (sessions + requests), clock=lambda: now[0])
    rng = random.Random(1)
    names = [f"session-{i}" for i in range(sessions)]
    keys = hash_keys(0, sessions + requests)
    for i, name in enumerate(names):  # every session's first turn
        now[0] += 0.01
        retention.note(Hint(name, rng.uniform(30, 60)), keys[i:i + 1])
    turns = [(rng.choice(names), rng.uniform(30, 60)) for _ in range(requests)]
    start = time.process_time()
    for i, (name, retain_s) in enumerate(turns, sessions):
        now[0] += 0.01
        retention.note(Hint(name, retain_s), keys[i:i + 1])
        retention.held()
    cpu = time.process_time() - start
    return {"sessions": sessions, "requests": requests, "us_per_request": cpu * 1e6 / requests,
            "tracked_at_end": len(retention.sessions), "expired": retention.stats.expired}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", default="100,1000,10000", help="session counts, comma-separated")
    parser.add_argument("--requests", type=int, default=20_000, help="timed requests per count")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    rows = [measure(int(count), args.requests) for count in args.sessions.split(",")]
    for row in rows:
        print(f"{row['sessions']:>6} sessions: {row['us_per_request']:7.1f} us per request "
              f"({row['tracked_at_end']} tracked at the end, {row['expired']} expired)")
    if args.json:
        with open(args.json, "w") as out_file:
            json.dump({**provenance(), "rows": rows}, out_file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
