"""Replacement-policy study on prefix-cache traces (issue 8).

- `replay_policy(trace, policy, capacity)`: hit rate and block ops/s of one policy in a single-tier,
  dry-run kvtier hierarchy, driven exactly as vLLM's scheduler drives it (`kvtier.bench.replay`).
- `optimum(trace, capacity)`: the offline ceiling (Belady's MIN adapted to prefix hits), from
  `kvtier.bench.optimum` (the CLI's `kvtier bench trace` reports it too).
- `grid(traces, policies, capacities)`: rows policy x capacity x trace, with the optimum.
- `plot(rows, path)`: hit rate vs capacity per policy, the optimum drawn as the ceiling.
- `trace_stats(trace)`: the numbers behind the analysis in docs/policies.md.

The CLI `kvtier bench trace --policies lru,arc,... --capacities 2k,10k,40k` replays the configured
hierarchy (`replay.sweep`) and adds `optimum` at each capacity; for a single-tier config its rows
equal `grid`'s, which `python -m benchmarks.policy_study TRACE... --policies ... --capacities ...`
prints as a table over several traces.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.optimum import optimum
from kvtier.bench.replay import parse_counts, replay_manager
from kvtier.bench.workloads import Trace, load_trace


def single_tier_config(policy: str, capacity: int, block_tokens: int = 512):
    """The single-tier dry-run config the study uses (one `memory` tier of `capacity` blocks)."""
    from kvtier.config import parse_config

    return parse_config({"block_tokens": block_tokens,
                         "tiers": [{"name": "cpu", "backend": "memory", "capacity": f"{capacity} blocks",
                                    "policy": policy}]})


def replay_policy(trace: Trace, policy: str, capacity: int) -> dict[str, Any]:
    """Replay `trace` through a single-tier dry-run hierarchy; returns hit_rate, block_ops_per_s, ..."""
    from kvtier.control.hierarchy import build_hierarchy

    hierarchy = build_hierarchy(single_tier_config(policy, capacity, trace.block_tokens), dry_run=True)
    try:
        result = replay_manager(hierarchy.manager, trace)
    finally:
        hierarchy.close()
    result.update(trace=trace.name, policy=policy, capacity_blocks=capacity)
    return result


def grid(traces: Sequence[Trace], policies: Iterable[str], capacities: Iterable[int],
         with_optimum: bool = True) -> list[dict[str, Any]]:
    """Rows of {trace, policy, capacity_blocks, hit_rate, block_ops_per_s, ...}; with `with_optimum`,
    one extra row per (trace, capacity) with policy "optimum" (no ops/s)."""
    rows: list[dict[str, Any]] = []
    policies = list(policies)
    capacities = list(capacities)
    for trace in traces:
        for cap in capacities:
            for policy in policies:
                rows.append(replay_policy(trace, policy, cap))
            if with_optimum:
                rows.append({"trace": trace.name, "policy": "optimum", "capacity_blocks": cap,
                             "hit_rate": optimum(trace, cap), "block_ops_per_s": None})
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table: one line per (trace, policy), one column per capacity (hit rate)."""
    caps = sorted({r["capacity_blocks"] for r in rows})
    order: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        order.setdefault((r["trace"], r["policy"]), {})[r["capacity_blocks"]] = r["hit_rate"]
    head = "| trace | policy | " + " | ".join(f"{c:,} blocks" for c in caps) + " |"
    lines = [head, "|" + "---|" * (len(caps) + 2)]
    for (trace, policy), by_cap in order.items():
        cells = " | ".join(f"{by_cap[c]:.4f}" if c in by_cap else "" for c in caps)
        lines.append(f"| {trace} | {policy} | {cells} |")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Hit rate vs capacity, one panel per trace, one line per policy; the optimum is drawn dashed
    as the ceiling. matplotlib is imported here only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        sub = [r for r in rows if r["trace"] == trace]
        for policy in dict.fromkeys(r["policy"] for r in sub):
            pts = sorted((r["capacity_blocks"], r["hit_rate"]) for r in sub if r["policy"] == policy)
            style = dict(color="black", linestyle="--", label="optimum (Belady)") if policy == "optimum" \
                else dict(marker="o", label=policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        ax.set_xscale("log")
        ax.set_xlabel("capacity (blocks)")
        ax.set_ylabel("block hit rate")
        ax.set_title(trace)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def trace_stats(trace: Trace) -> dict[str, Any]:
    """Why recency alone loses: one-time blocks, the last (partial) block of each request, reuse
    by depth, and the reuse distance (in distinct blocks) of reused blocks."""
    counts: dict[int, int] = {}
    for row in trace.requests:
        for h in row:
            counts[h] = counts.get(h, 0) + 1
    once = sum(1 for c in counts.values() if c == 1)
    last_once = sum(1 for row in trace.requests if row and counts[row[-1]] == 1)
    last_blocks = sum(1 for row in trace.requests if row)
    head_reused = sum(1 for row in trace.requests if row and counts[row[0]] > 1)
    # Reuse distance: blocks stored between two uses of the same block (an LRU stack distance proxy).
    last_seen: dict[int, int] = {}
    clock = 0
    distances: list[int] = []
    for row in trace.requests:
        for h in row:
            if h in last_seen:
                distances.append(clock - last_seen[h])
        for h in row:
            last_seen[h] = clock
            clock += 1
    distances.sort()

    def pct(q: float) -> int:
        return distances[int(q * (len(distances) - 1))] if distances else 0

    return {
        "trace": trace.name, "requests": len(trace.requests), "blocks": trace.total_blocks,
        "unique_blocks": len(counts), "one_time_blocks": once, "one_time_share_of_unique": once / len(counts),
        "last_block_one_time_share": last_once / max(1, last_blocks),
        "first_block_reused_share": head_reused / max(1, last_blocks),
        "reuse_distance_p50": pct(0.5), "reuse_distance_p90": pct(0.9), "reuse_distance_p99": pct(0.99),
        "unlimited_hit_rate": trace.optimum_hit_rate(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.policy_study", description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--policies", default="lru,arc")
    ap.add_argument("--capacities", default="2k,10k,40k")
    ap.add_argument("--plot", default=None, help="write a PNG of hit rate vs capacity here")
    ap.add_argument("--no-optimum", action="store_true")
    args = ap.parse_args(argv)
    traces = [load_trace(p) for p in args.traces]
    rows = grid(traces, [p for p in args.policies.split(",") if p], parse_counts(args.capacities),
                with_optimum=not args.no_optimum)
    print(format_table(rows))
    print()
    for r in rows:
        if r.get("block_ops_per_s"):
            print(f"{r['trace']} {r['policy']} @{r['capacity_blocks']}: {r['block_ops_per_s']:,.0f} block ops/s "
                  f"({r['seconds']:.2f}s)")
    if args.plot:
        print("plot:", plot(rows, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
