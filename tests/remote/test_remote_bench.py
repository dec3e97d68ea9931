"""The remote benchmark functions run and report every figure (no timing is asserted here)."""

from __future__ import annotations

import json

from kvtier.remote import bench


def test_data_path_and_probe_report_their_figures(valkey_server, tmp_path):
    row = bench.data_path(valkey_server.url, 4096, rounds=2, blocks=2)
    for name in ("raw_set", "write", "raw_get", "read"):
        assert row[f"{name}_gbps"] > 0 and row[f"{name}_us_p50"] > 0
    assert row["ops_each"] == 4 and row["write_vs_raw_set"] > 0 and row["read_vs_raw_get"] > 0
    probe = bench.probe(valkey_server.url, keys=8, repeats=3, tp=2)
    assert probe["servers"] == 1 and probe["probe_us_p50"] <= probe["probe_us_p99"]
    assert probe["raw_pipeline_us_p50"] > 0
    out = tmp_path / "bench.json"
    assert bench.main(["--url", valkey_server.url, "--sizes", "4096", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["data_path"][0]["block_bytes"] == 4096


def test_probe_on_a_cluster(valkey_cluster):
    probe = bench.probe(valkey_cluster.url, keys=16, repeats=3)
    assert probe["servers"] == 3 and "raw_pipeline_us_p50" not in probe
