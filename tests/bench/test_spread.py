"""Repeated hop measurements: medians, spread, and flags that keep a noisy ratio out of the Summary."""

from __future__ import annotations

from kvtier.bench import hops_report
from kvtier.bench.spread import annotate, spread

MB = 10**6


def _row(ours_s, base_s, nbytes=100 * MB, **kw):
    return annotate({"hop": "CPU->FILE", "block_bytes": 1 << 20, "baseline": "raw O_DIRECT write"}, ours_s, base_s,
                    nbytes, **kw)


def test_medians_samples_and_ratio_of_medians():
    row = _row([0.1, 0.2, 0.1, 0.1, 0.1], [0.05, 0.05, 0.06, 0.05, 0.05])
    assert row["samples_gbps"] == [1.0, 0.5, 1.0, 1.0, 1.0] and row["gbps"] == 1.0 and row["repeats"] == 5
    assert row["baseline_gbps"] == 2.0 and row["ratio"] == 0.5
    assert row["spread"] == 0.0  # one outlier of five does not count
    assert row["flags"] == []


def test_spread_is_the_interquartile_range_over_the_median():
    assert spread([1.0]) == 0.0
    assert spread([1.0, 2.0, 3.0]) == 0.5  # with three samples: half the range
    assert spread([10.0, 10.0, 10.0, 10.0, 10.0]) == 0.0


def test_an_unstable_side_is_flagged():
    row = _row([0.1, 0.1, 0.1], [0.05, 0.1, 0.2])
    assert row["flags"] == ["baseline-unstable"]
    row = _row([0.05, 0.1, 0.2], [0.1, 0.1, 0.1])
    assert row["flags"] == ["kvtier-unstable"]


def test_a_host_baseline_that_fits_in_the_cache_is_flagged():
    assert _row([0.1] * 3, [0.1] * 3, nbytes=16 << 20, host_copy=True, cache_bytes=32 << 20)["flags"] == [
        "cache-resident"]
    assert _row([0.1] * 3, [0.1] * 3, nbytes=64 << 20, host_copy=True, cache_bytes=32 << 20)["flags"] == []
    assert _row([0.1] * 3, [0.1] * 3, nbytes=16 << 20, cache_bytes=32 << 20)["flags"] == []  # not a host copy


def test_absurd_ratios_are_flagged():
    assert _row([0.01] * 3, [0.1] * 3)["flags"] == ["ratio-high"]  # 1000 %: the baseline is no ceiling
    assert _row([1.0] * 3, [0.01] * 3)["flags"] == ["ratio-low"]  # 1 %
    assert _row([0.1] * 3, [0.08] * 3)["flags"] == []  # 80 %: a finding


def test_the_summary_never_presents_a_flagged_ratio_as_a_finding():
    clean = _row([0.1] * 3, [0.08] * 3)
    noisy = {**_row([0.1] * 3, [0.01, 0.1, 0.3]), "hop": "FILE->CPU", "baseline": "raw O_DIRECT read"}
    lines = hops_report.summary([clean, noisy])
    assert "CPU->FILE: 80% of raw O_DIRECT write (1.25 GB/s) at 1MiB, medians of 3 rounds" in lines
    [noisy_line] = [line for line in lines if line.startswith("FILE->CPU")]
    assert "ratio unreliable" in noisy_line and "baseline's samples spread over 25%" in noisy_line
    assert "%" not in noisy_line.split("(")[0]  # no ratio figure before the reason
    table = "\n".join(hops_report.table([clean, noisy]))
    assert " 80% " in table and "?  baseline-unstable" in table and "? flagged ratio, not a finding" in table
