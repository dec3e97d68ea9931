"""Repeated hop measurements: medians, spread, and flags that keep a noisy ratio out of the Summary."""

from __future__ import annotations

from kvtier.bench import hops_report, hops_runner
from kvtier.bench import spread as spread_module
from kvtier.bench.spread import annotate, flag_baseline_jumps, spread

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


def _copy_row(hop, slots, size, base_gbps, ours_gbps=4.0):
    """An engine<->CPU row of one run as `kvtier.bench.hops` makes it (40 MiB copies)."""
    nbytes = 40 << 20
    row = {"hop": hop, "slots": slots, "device": "cpu", "block_bytes": size, "baseline": "one contiguous copy",
           "baseline_key": f"{hop} one contiguous copy of {nbytes} bytes on cpu"}
    return annotate(row, [nbytes / ours_gbps / 1e9] * 3, [nbytes / g / 1e9 for g in base_gbps], nbytes)


def test_a_baseline_that_jumps_between_rows_of_one_run_is_flagged_not_reported():
    """Issue 36.9: `bench --quick` said 'CPU->engine scattered: 18 % of one contiguous copy (35.55
    GB/s) at 1MiB': that row's baseline samples (35.6 / 38.3 / 24.0 GB/s) agreed well enough, but
    the same copy ran at 4-7 GB/s in every other row of the run."""
    rows = [_copy_row("CPU->GPU", "consecutive", 64 << 10, [5.2, 5.3, 5.4]),
            _copy_row("CPU->GPU", "scattered", 64 << 10, [6.0, 6.3, 6.5]),
            _copy_row("CPU->GPU", "consecutive", 1 << 20, [6.5, 6.8, 7.0]),
            _copy_row("CPU->GPU", "scattered", 1 << 20, [35.6, 38.3, 24.0], ours_gbps=6.4),
            _copy_row("GPU->CPU", "consecutive", 1 << 20, [5.0, 5.3, 5.5])]
    assert rows[3]["flags"] == []  # alone, the row looks sound
    flag_baseline_jumps(rows)
    assert [r["flags"] for r in rows] == [[], [], [], ["baseline-jump"], []]
    lines = hops_report.summary(rows)
    [line] = [line for line in lines if line.startswith("CPU->engine scattered")]
    assert line == ("CPU->engine scattered at 1MiB: ratio unreliable (the baseline ran over 1.5x off the same "
                    "copy's median in this run's other rows, from cache or in a busy patch: no ceiling here); "
                    "not a finding")
    assert "CPU->engine: 59% of one contiguous copy (6.80 GB/s) at 1MiB, medians of 3 rounds" in lines


def test_the_cpu_cache_is_the_larger_of_what_sysfs_and_the_cpu_say(monkeypatch):
    """On this project's VM sysfs shows a 32 MiB L3 and the CPU (glibc's sysconf) 320 MiB: a 40 MiB
    host copy ran from cache unflagged on 7e6c7c1, which read sysfs only."""
    monkeypatch.setattr(spread_module, "sysfs_cache_bytes", lambda: 32 << 20)
    monkeypatch.setattr(spread_module, "sysconf_cache_bytes", lambda: 320 << 20)
    assert spread_module.last_level_cache_bytes() == 320 << 20
    assert _row([0.1] * 3, [0.1] * 3, nbytes=40 << 20, host_copy=True)["flags"] == ["cache-resident"]
    monkeypatch.setattr(spread_module, "sysconf_cache_bytes", lambda: None)
    assert spread_module.last_level_cache_bytes() == 32 << 20
    monkeypatch.setattr(spread_module, "sysfs_cache_bytes", lambda: None)
    assert spread_module.last_level_cache_bytes() is None


def test_host_copies_of_an_engine_hop_outgrow_the_cpu_cache(monkeypatch):
    monkeypatch.setattr(hops_runner, "last_level_cache_bytes", lambda: 320 << 20)
    assert hops_runner.engine_hop_bytes("cpu", quick=True) == 328 << 20
    assert hops_runner.engine_hop_bytes("cpu", quick=False) == 328 << 20
    assert hops_runner.engine_hop_bytes("cuda", quick=True) == 40 << 20  # device memory: no CPU cache
    monkeypatch.setattr(hops_runner, "last_level_cache_bytes", lambda: 16 << 20)
    assert hops_runner.engine_hop_bytes("cpu", quick=True) == 40 << 20
