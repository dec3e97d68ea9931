"""The side-by-side view of a session replay (`kvtier bench trace --hints ...`): per swept capacity,
kvtier's policies without and with hints, vLLM's LRU and ARC, the offline optimum, an LRU that
knows every session's end (`ends_known`: the most that `session_ended` hints can buy), and

- `gap_closed` per hinted policy: (hinted - vLLM's best) / (optimum - vLLM's best); None when
  vLLM did not run or already reaches the optimum (no gap to close);
- `margin` per policy without hints: its hit rate - vLLM's best, and per policy over all
  capacities whether it is never below vLLM's best by more than `TOLERANCE` (`within`) and
  whether it is above it at every capacity (`above`).
"""

from __future__ import annotations

from typing import Any

TOLERANCE = 0.002  # hit rate: "not below vLLM's best" allows this much


def compare(runs: list[dict[str, Any]], optimum: list[dict[str, Any]]) -> dict[str, Any]:
    """`by_capacity` rows and the `checks` over them, from `sweep`'s rows and the optimum rows."""
    ceiling = {o["capacity_blocks"]: o["hit_rate"] for o in optimum}
    ends = {o["capacity_blocks"]: o.get("ends_known") for o in optimum}
    rows = []
    for cap in sorted({r["capacity_blocks"] for r in runs}):
        at = [r for r in runs if r["capacity_blocks"] == cap]
        vllm = {r["policy"]: r["hit_rate"] for r in at if r["system"] == "vllm"}
        plain = {r["policy"]: r["hit_rate"] for r in at if r["system"] == "kvtier" and not r.get("hints")}
        hinted = {r["policy"]: r["hit_rate"] for r in at if r["system"] == "kvtier" and r.get("hints")}
        best = max(vllm.values()) if vllm else None
        top = ceiling.get(cap)
        gap = (top - best) if top is not None and best is not None else None
        rows.append({
            "capacity_blocks": cap, "kvtier": plain, "kvtier_hints": hinted, "vllm": vllm, "vllm_best": best,
            "optimum": top, "ends_known": ends.get(cap),
            "gap_closed": {p: (h - best) / gap if gap and gap > 1e-9 else None for p, h in hinted.items()},
            "margin": {p: h - best for p, h in plain.items()} if best is not None else {},
        })
    checks: dict[str, Any] = {}
    for policy in sorted({p for row in rows for p in row["margin"]}):
        margins = [row["margin"][policy] for row in rows if policy in row["margin"]]
        checks[policy] = {"worst_margin": min(margins), "within": min(margins) >= -TOLERANCE,
                          "above": min(margins) > 0}
    return {"by_capacity": rows, "no_hints_vs_vllm_best": checks}


def table(report: dict[str, Any]) -> list[str]:
    """The printed lines: one row per capacity."""
    rows = report["by_capacity"]
    plain = sorted({p for r in rows for p in r["kvtier"]})
    hinted = sorted({p for r in rows for p in r["kvtier_hints"]})
    vllm = sorted({p for r in rows for p in r["vllm"]})
    closing = hinted if vllm else []  # (no gap closed without vLLM's rows to measure it from)
    heads = ([f"{p}" for p in plain] + [f"{p}+hints" for p in hinted] + [f"vllm {p}" for p in vllm]
             + ["ends known", "optimum"] + [f"gap closed {p}" for p in closing])
    widths = [max(8, len(h) + 2) for h in heads]
    lines = [f"{'tier0 blocks':>12}" + "".join(f"{h:>{w}}" for h, w in zip(heads, widths))]
    for r in rows:
        cells = ([r["kvtier"].get(p) for p in plain] + [r["kvtier_hints"].get(p) for p in hinted]
                 + [r["vllm"].get(p) for p in vllm] + [r["ends_known"], r["optimum"]]
                 + [r["gap_closed"].get(p) for p in closing])
        lines.append(f"{r['capacity_blocks']:>12}" + "".join(
            f"{'-' if c is None else f'{c:.4f}':>{w}}" for c, w in zip(cells, widths)))
    for policy, c in report["no_hints_vs_vllm_best"].items():
        lines.append(f"{policy} without hints vs vLLM's best: worst {c['worst_margin']:+.4f}; "
                     f"within {TOLERANCE}: {'yes' if c['within'] else 'NO'}; above at every size: "
                     f"{'yes' if c['above'] else 'no'}")
    return lines


def summary(report: dict[str, Any], trace: str) -> list[str]:
    """The Summary's sentences: the gap closed per size (where vLLM ran: the gap is measured from
    its best), the no-hints check per policy."""
    lines = []
    for r in report["by_capacity"]:
        if r["vllm_best"] is None or not r["gap_closed"]:
            continue
        if all(g is None for g in r["gap_closed"].values()):
            lines.append(f"{trace} @ {r['capacity_blocks']} blocks: no gap for hints to close (vLLM's best "
                         f"{r['vllm_best']:.4f} reaches the optimum)")
            continue
        closed = ", ".join(f"{p} {'-' if g is None else f'{g:.2f}'}" for p, g in r["gap_closed"].items())
        lines.append(f"{trace} @ {r['capacity_blocks']} blocks: with hints, gap to the optimum closed "
                     f"(1 = all of it, from vLLM's best): {closed}")
    for policy, c in report["no_hints_vs_vllm_best"].items():
        lines.append(f"{trace}: {policy} without hints is {c['worst_margin']:+.4f} from vLLM's best at its worst size "
                     f"({'within' if c['within'] else 'NOT within'} {TOLERANCE})")
    return lines
