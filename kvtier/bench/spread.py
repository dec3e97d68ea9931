"""Repeated hop measurements: median, spread, and the flags that make a ratio untrustworthy.

A hop row of `kvtier bench hops` carries, for kvtier and for its same-run baseline, every sample
(GB/s per repetition), their median and their spread, and `flags`: the reasons its ratio
(median / median) is not a finding. `annotate(row, ours_s, base_s, nbytes)` fills those keys in
from per-repetition seconds. Pure Python: no torch, no I/O.

Flags (codes, stable in JSON; `FLAG_TEXT` words them):
  - `kvtier-unstable` / `baseline-unstable`: that side's spread is over `UNSTABLE_SPREAD`;
  - `cache-resident`: the bytes one copy moves fit in the CPU's last-level cache (source and
    destination together in twice its size), so a host baseline runs largely from cache, faster
    than any real transfer (`last_level_cache_bytes`: the larger of what sysfs and the CPU say);
  - `baseline-jump` (`flag_baseline_jumps`, over all the rows of one run): the baseline's median is
    over `BASELINE_JUMP` times off the median of the same copy in the run's other rows (same
    `baseline_key`: what it copies, how many bytes, where), so it ran from cache or in a busy patch
    in that row: its samples can agree with each other and still be no ceiling;
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
BASELINE_JUMP = 1.5  # the same copy measured this many times faster (or slower) in one row than in the others
# glibc's sysconf names for the CPU's own cache sizes (from CPUID), absent from os.sysconf_names:
# _SC_LEVEL2_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE, _SC_LEVEL4_CACHE_SIZE of <bits/confname.h>.
_GLIBC_CACHE_SIZES = (191, 194, 197)
DEFAULT_REPEATS = 5
QUICK_REPEATS = 3

FLAG_TEXT = {
    "kvtier-unstable": "kvtier's samples spread over {unstable:.0%}",
    "baseline-unstable": "the baseline's samples spread over {unstable:.0%}",
    "cache-resident": "the bytes fit in the CPU cache, so the baseline ran from cache",
    "ratio-high": "kvtier beat its baseline by over {high:.0%}: the baseline is no ceiling here",
    "ratio-low": "kvtier reached under {low:.0%} of its baseline: a stall, not a property of the path",
    "baseline-jump": "the baseline ran over {jump:.1f}x off the same copy's median in this run's other rows, "
                     "from cache or in a busy patch: no ceiling here",
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
    """The largest CPU cache of this machine in bytes, or None where unknown: the larger of what
    Linux sysfs says (under a hypervisor, the topology it shows: 32 MiB of L3 on this project's VM)
    and what the CPU itself says through glibc's sysconf (CPUID: 320 MiB there, the L3 the VM's
    copies actually share)."""
    return max(filter(None, (sysfs_cache_bytes(), sysconf_cache_bytes())), default=None)


def sysfs_cache_bytes() -> int | None:
    """The largest CPU cache Linux sysfs lists for cpu0, in bytes (None: no sysfs)."""
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


def sysconf_cache_bytes() -> int | None:
    """The largest of the CPU's L2, L3 and L4 cache sizes glibc's sysconf reports (None: not glibc)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        sizes = [os.sysconf(name) for name in _GLIBC_CACHE_SIZES]
    except (ValueError, OSError, AttributeError):  # not glibc, or a libc without these names
        return None
    return max((size for size in sizes if size > 0), default=None)


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


def flag_baseline_jumps(rows: Sequence[dict[str, Any]]) -> None:
    """Flag `baseline-jump` on each row whose baseline median is over `BASELINE_JUMP` times above
    or below the median of the baseline medians of every row of `rows` (one run) with its
    `baseline_key`; rows without one, or alone with theirs, are left as they are."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("baseline_key") and row.get("baseline_gbps"):
            groups.setdefault(row["baseline_key"], []).append(row)
    for group in groups.values():
        if len(group) < 2:
            continue
        typical = median(row["baseline_gbps"] for row in group)
        for row in group:
            off = max(row["baseline_gbps"] / typical, typical / row["baseline_gbps"])
            if off > BASELINE_JUMP and "baseline-jump" not in row["flags"]:
                row["flags"].append("baseline-jump")


def flag_reasons(row: dict[str, Any]) -> str:
    """The row's flags in words, joined by '; ' ("" when it has none)."""
    values = {"unstable": UNSTABLE_SPREAD, "high": RATIO_HIGH - 1, "low": RATIO_LOW, "jump": BASELINE_JUMP}
    return "; ".join(FLAG_TEXT[f].format(**values) for f in row.get("flags", ()))
