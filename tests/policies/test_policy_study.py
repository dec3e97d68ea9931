"""benchmarks.policy_study on small generated traces: replay, optimum, grid, table."""

from __future__ import annotations

import pytest

from benchmarks.policy_study import format_table, grid, optimum, replay_policy, trace_stats
from kvtier.bench.workloads import Trace, generate_trace
from kvtier.transfer.registry import POLICIES


@pytest.fixture(scope="module")
def trace() -> Trace:
    return generate_trace(num_conversations=60, turns=4, system_prompts=3, system_blocks=4, turn_blocks=3, seed=3)


def test_optimum_bounds_every_policy(trace):
    unlimited = trace.optimum_hit_rate()
    for cap in (16, 64, 256):
        best = optimum(trace, cap)
        assert best <= unlimited + 1e-12
        for name in POLICIES:
            assert replay_policy(trace, name, cap)["hit_rate"] <= best + 1e-12
    assert optimum(trace, 10**6) == pytest.approx(unlimited)
    assert optimum(trace, None) == unlimited


def test_optimum_on_a_crafted_trace():
    # capacity 3: keep [1, 2, 3] for the third request (its next use is the soonest); 2 + 3 hits
    t = Trace("t", [[1, 2, 3], [7, 8, 9], [1, 2, 3]])
    assert optimum(t, 3) == pytest.approx(3 / 9)
    assert optimum(t, 2) == pytest.approx(2 / 9)  # only a prefix can be kept


def test_grid_rows_and_table(trace):
    rows = grid([trace], ["lru", "prefix-freq"], [32, 128])
    assert {(r["policy"], r["capacity_blocks"]) for r in rows} == {
        (p, c) for p in ("lru", "prefix-freq", "optimum") for c in (32, 128)}
    assert all(r["block_ops_per_s"] > 0 for r in rows if r["policy"] != "optimum")
    table = format_table(rows)
    assert "| optimum |" in table and "128 blocks" in table


def test_trace_stats(trace):
    stats = trace_stats(trace)
    assert stats["unique_blocks"] <= stats["blocks"]
    assert 0 <= stats["one_time_share_of_unique"] <= 1
