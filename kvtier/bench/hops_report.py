"""The hop table and the hop sentences of the Summary, from `kvtier bench hops` rows.

A row whose ratio is flagged (`kvtier.bench.spread`) is printed with `?` after its ratio and its
flags, and the Summary says why its ratio is unreliable instead of presenting it as a finding.
"""

from __future__ import annotations

from typing import Any

from kvtier.bench.hops_runner import hop_label
from kvtier.bench.spread import FLAG_TEXT, flag_reasons
from kvtier.config import format_size

HEADER = (f"{'hop':<22}{'block':>7}{'kvtier GB/s':>12}{'spread':>7}  {'baseline':<24}{'GB/s':>7}{'spread':>7}"
          f"{'ratio':>8}  flags")


def ratio(row: dict[str, Any]) -> float | None:
    """kvtier's median over the baseline's (None without a baseline)."""
    if "ratio" in row:
        return float(row["ratio"])
    base = row.get("baseline_gbps")
    return row["gbps"] / base if base else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The table's lines: a header, one line per row, and the meaning of each flag that occurs."""
    lines = [HEADER]
    for r in rows:
        value = ratio(r)
        mark = "?" if r.get("flags") else " "
        shown = f"{_pct(value)}{mark}" if value is not None else "-"
        lines.append(f"{hop_label(r):<22}{format_size(r['block_bytes']):>7}{r['gbps']:>12.2f}"
                     f"{_pct(r.get('spread')):>7}  {r.get('baseline', '-'):<24}{r.get('baseline_gbps') or 0:>7.2f}"
                     f"{_pct(r.get('baseline_spread')):>7}{shown:>8}  {','.join(r.get('flags', ()))}")
    seen = [f for f in FLAG_TEXT if any(f in r.get("flags", ()) for r in rows)]
    if seen:
        lines.append("? flagged ratio, not a finding: " + "; ".join(
            f"{f}: {flag_reasons({'flags': [f]})}" for f in seen))
    return lines


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Summary sentences: the bottleneck hop at the largest block size, then each hop's ratio there,
    or why that ratio is unreliable."""
    if not rows:
        return ["no hop could be measured on this machine"]
    largest = max(r["block_bytes"] for r in rows)
    at_largest = [r for r in rows if r["block_bytes"] == largest]
    slowest = min(at_largest, key=lambda r: r["gbps"])
    size = format_size(largest)
    lines = [f"bottleneck hop: {hop_label(slowest)} at {slowest['gbps']:.2f} GB/s (median) with {size} blocks"]
    for r in at_largest:
        value = ratio(r)
        if value is None:
            continue
        if r.get("flags"):
            lines.append(f"{hop_label(r)} at {size}: ratio unreliable ({flag_reasons(r)}); not a finding")
        else:
            lines.append(f"{hop_label(r)}: {value:.0%} of {r['baseline']} ({r['baseline_gbps']:.2f} GB/s) at "
                         f"{size}, medians of {r.get('repeats', 1)} rounds")
    return lines
