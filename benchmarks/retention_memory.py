"""Memory of the sessions' retention (issue 40: "<= 100 B per resident block plus a stated bound
per live session"), measured with tracemalloc.

    python -m benchmarks.retention_memory [--sessions 2000] [--blocks 16,64] [--json FILE]

A `Retention` of a first tier large enough that nothing is displaced notes `--sessions`
sessions, each one turn that stores `blocks` new blocks (36-byte keys, created for the turn as
vLLM's scheduler creates them: the retention is what keeps them alive). Reported, in bytes:
`per_session` (the session's record, its name, its places in the retention's ordered maps) and
`per_retained_block` / `per_stored_block` (a key retained by its session; a key remembered as
one the session stored, which makes it a first victim when the session ends), fitted from two
sizes of turn. The index's own bytes per resident block (`benchmarks.memory`) do not change:
hints add a flag the tables already had (`BlockTable.hold`).

The bounds that follow (`Retention`'s docstring): retained keys at most `share` (0.5) of the
first tier, stored keys remembered at most twice the first tier, at most `max_sessions`
(10,000) sessions. This is a benchmark, not a test: it prints rows and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from typing import Any

from benchmarks.memory import hash_keys
from kvtier.bench.provenance import provenance
from kvtier.control.hints import Hint
from kvtier.control.retention import MAX_SESSIONS, RETAINED_SHARE, Retention


def measure(sessions: int, blocks: int) -> int:
    """Bytes the retention holds after `sessions` turns of `blocks` new keys each (tracemalloc)."""
    retention = Retention(capacity=4 * sessions * blocks, max_sessions=sessions + 1, clock=lambda: 0.0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in range(sessions):
        keys = hash_keys(s * blocks, (s + 1) * blocks)
        retention.note(Hint(f"session-{s:06d}", 600.0, tenant="tenant-a"), keys, stored=keys)
        del keys
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(retention.retained) == sessions * blocks and len(retention.sessions) == sessions
    return held


def run(sessions: int, sizes: list[int]) -> dict[str, Any]:
    """Per-session and per-block bytes, from turns of `sizes` blocks (a line through two sizes)."""
    totals = {blocks: measure(sessions, blocks) for blocks in sizes}
    small, large = min(sizes), max(sizes)
    per_block = (totals[large] - totals[small]) / (sessions * (large - small))
    per_session = totals[small] / sessions - per_block * small
    # Each block is both retained and stored here; split the per-block cost by measuring stores alone.
    retention = Retention(capacity=4 * sessions * large, max_sessions=sessions + 1, clock=lambda: 0.0)
    keys = hash_keys(0, large)
    retention.note(Hint("probe", 600.0), keys)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in range(sessions):
        session = retention.sessions["probe"]
        session.stored.update(dict.fromkeys(hash_keys(10**9 + s * large, 10**9 + (s + 1) * large)))
    gc.collect()
    stored_only = (tracemalloc.get_traced_memory()[0] - before) / (sessions * large)
    tracemalloc.stop()
    key_bytes = (sys.getsizeof(hash_keys(0, 1)[0]) + 7) // 8 * 8  # (pymalloc's 8-byte size classes)
    return {"sessions": sessions, "turn_blocks": sizes, "total_bytes": totals,
            "per_session": round(per_session, 1), "per_block_retained_and_stored": round(per_block, 1),
            "per_stored_block": round(stored_only, 1), "per_retained_block": round(per_block - stored_only, 1),
            # a retained key that nothing else keeps alive (claimed from another session, say)
            "per_retained_block_with_key": round(per_block - stored_only + key_bytes, 1),
            "bounds": {"retained_share_of_first_tier": RETAINED_SHARE, "stored_per_first_tier_block": 2,
                       "max_sessions": MAX_SESSIONS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--blocks", default="16,64", help="two turn sizes, in blocks")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    sizes = sorted({int(b) for b in args.blocks.split(",")})
    if len(sizes) != 2 or sizes[0] < 1:
        parser.error("--blocks: give two different positive turn sizes, e.g. 16,64")
    result = run(args.sessions, sizes)
    per_tier_block = RETAINED_SHARE * result["per_retained_block_with_key"] + 2 * result["per_stored_block"]
    result["bound_per_first_tier_block"] = round(per_tier_block, 1)
    print(f"per session {result['per_session']:.0f} B; per retained block {result['per_retained_block']:.0f} B "
          f"({result['per_retained_block_with_key']:.0f} B with its key); per stored block remembered "
          f"{result['per_stored_block']:.0f} B (key included)")
    print(f"bound: {per_tier_block:.0f} B per first-tier block ({RETAINED_SHARE:g} retained + 2 remembered) "
          f"+ {result['per_session']:.0f} B x up to {MAX_SESSIONS:,} sessions")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**provenance(), "retention_memory": result}, f, indent=2)


if __name__ == "__main__":
    main()
