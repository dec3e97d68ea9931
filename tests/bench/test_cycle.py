"""The request-cycle benchmark (issue 19): its workloads and its rows."""

from __future__ import annotations

import json

from benchmarks import cycle
from kvtier.bench.workloads import generate_scan_trace


def test_scan_workload_mixes_hot_prefixes_with_documents_read_once():
    trace = generate_scan_trace(num_requests=400, prefixes=3, prefix_blocks=5, doc_blocks=(20, 30), seed=1)
    assert trace == generate_scan_trace(num_requests=400, prefixes=3, prefix_blocks=5, doc_blocks=(20, 30), seed=1)
    scans = [r for r in trace.requests if len(r) >= 20]
    chats = [r for r in trace.requests if len(r) < 20]
    assert 0.15 < len(scans) / len(trace.requests) < 0.35
    assert len({tuple(r[:5]) for r in chats}) == 3  # every chat starts with one of the hot prefixes
    scanned = [h for r in scans for h in r]
    everything_else = {h for r in chats for h in r}
    assert len(set(scanned)) == len(scanned) and everything_else.isdisjoint(scanned)  # read once


def test_cycle_rows_carry_hit_rates_and_cpu_cost(tmp_path, monkeypatch):
    monkeypatch.setattr(cycle, "load_workload", lambda name, traces: generate_scan_trace(num_requests=60))
    out = tmp_path / "rows.json"
    assert cycle.main(["--workloads", "scan", "--systems", "lru,prefix-freq,prefix-freq+file", "--repeats", "2",
                       "--capacity", "200", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["lru", "prefix-freq", "prefix-freq+file"]
    blocks = generate_scan_trace(num_requests=60).total_blocks
    for row in rows:
        assert row["blocks"] == blocks and 0 < row["hit_rate"] < 1 and row["cpu_us_per_block"] > 0
