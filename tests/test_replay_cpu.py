"""`replay_manager` reports CPU time per trace block (issue 19 item 4) beside ops/s."""

from __future__ import annotations

from conftest import memory_hierarchy

from kvtier.bench.replay import replay_manager
from kvtier.bench.workloads import generate_trace


def test_replay_reports_cpu_time_per_trace_block():
    trace = generate_trace(num_conversations=20, turns=2)
    hierarchy = memory_hierarchy(hot=16, warm=64)
    try:
        result = replay_manager(hierarchy.manager, trace)
    finally:
        hierarchy.close()
    assert result["blocks"] == trace.total_blocks > 0
    assert result["cpu_seconds"] > 0
    assert result["cpu_us_per_block"] == result["cpu_seconds"] * 1e6 / trace.total_blocks
    assert result["block_ops_per_s"] > 0
