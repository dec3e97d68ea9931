"""Repeated hop measurements: median, spread, and the flags that make a ratio untrustworthy.

A hop row of `kvtier bench hops` carries, for kvtier and for its same-run baseline, every sample
(GB/s per repetition), their median and their spread, and `flags`: the reasons its ratio
(median / median) is not a finding. `annotate(row, ours_s, base_s, nbytes)` fills those keys in
from per-repetition seconds. Pure Python: no torch, no I/O.

Flags (codes, stable in JSON; `FLAG_TEXT` words them):
  - `kvtier-unstable` / `baseline-unstable`: that side's spread is over `UNSTABLE_SPREAD`;
  - `cache-resident`: the bytes one copy moves fit in the CPU's last-level cache (source and
    destination together in twice its size), so a host baseline runs largely from cache, faster
    than any real transfer;
  - `ratio-high`: kvtier beat its baseline by more than `RATIO_HIGH` (the baseline is no ceiling);
  - `ratio-low`: kvtier reached less than `RATIO_LOW` of it (a stall, not a property of the path).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from statistics import median, quantiles
from typing import Any

UNSTABLE_SPREAD = 0.25  # interquartile range / median above this: the samples disagree too much to compare
RATIO_HIGH = 1.30  # a baseline is meant to be the ceiling; 30 % beyond it is measurement noise
RATIO_LOW = 0.05  # below 5 % of the ceiling, something stalled: not a figure of the path
DEFAULT_REPEATS = 5
QUICK_REPEATS = 3

FLAG_TEXT = {
    "kvtier-unstable": "kvtier's samples spread over {unstable:.0%}",
    "baseline-unstable": "the baseline's samples spread over {unstable:.0%}",
    "cache-resident": "the bytes fit in the CPU cache, so the baseline ran from cache",
    "ratio-high": "kvtier beat its baseline by over {high:.0%}: the baseline is no ceiling here",
    "ratio-low": "kvtier reached under {low:.0%} of its baseline: a stall, not a property of the path",
}


def default_repeats(quick: bool) -> int:
    return QUICK_REPEATS if quick else DEFAULT_REPEATS


def spread(samples: Sequence[float]) -> float:
    """Interquartile range / median of `samples` (inclusive quartiles: with 5 samples, one outlier
    does not count; with 3, half the range); 0 for fewer than two."""
    if len(samples) < 2:
        return 0.0
    mid = median(samples)
    q1, _, q3 = quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / mid if mid > 0 else float("inf")


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of this machine in bytes (Linux sysfs), or None where unknown."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        names = os.listdir(base)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(base, name, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best or 0, int(digits) * scale)
    return best


def annotate(row: dict[str, Any], ours_s: Sequence[float], base_s: Sequence[float] | None, nbytes: int,
             host_copy: bool = False, cache_bytes: int | None = None) -> dict[str, Any]:
    """Fill `row` from per-repetition seconds of kvtier (`ours_s`) and its baseline (`base_s`,
    None when it has none) over `nbytes`: `samples_gbps`, `gbps` (median), `spread`, the same
    with a `baseline_` prefix, `ratio` (median / median) and `flags`. `host_copy`: the baseline
    is a copy in host memory, which the CPU cache can serve (`cache_bytes`: its size, default
    this machine's). Returns `row`."""
    ours = [nbytes / s / 1e9 for s in ours_s]
    row.update(samples_gbps=ours, gbps=median(ours), spread=spread(ours), repeats=len(ours))
    flags: list[str] = []
    if row["spread"] > UNSTABLE_SPREAD:
        flags.append("kvtier-unstable")
    if base_s:
        base = [nbytes / s / 1e9 for s in base_s]
        row.update(baseline_samples_gbps=base, baseline_gbps=median(base), baseline_spread=spread(base))
        row["ratio"] = row["gbps"] / row["baseline_gbps"]
        if row["baseline_spread"] > UNSTABLE_SPREAD:
            flags.append("baseline-unstable")
        cache = cache_bytes if cache_bytes is not None else (last_level_cache_bytes() if host_copy else None)
        if host_copy and cache and nbytes <= cache:
            flags.append("cache-resident")
        if row["ratio"] > RATIO_HIGH:
            flags.append("ratio-high")
        elif row["ratio"] < RATIO_LOW:
            flags.append("ratio-low")
    row["flags"] = flags
    return row


def flag_reasons(row: dict[str, Any]) -> str:
    """The row's flags in words, joined by '; ' ("" when it has none)."""
    values = {"unstable": UNSTABLE_SPREAD, "high": RATIO_HIGH - 1, "low": RATIO_LOW}
    return "; ".join(FLAG_TEXT[f].format(**values) for f in row.get("flags", ()))
