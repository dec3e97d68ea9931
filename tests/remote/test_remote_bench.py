"""The remote benchmark functions run and report every figure (no timing is asserted here)."""

from __future__ import annotations

import json

from kvtier.tiers.remote import bench


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


def test_bench_hops_writes_under_the_tiers_prefix_as_its_acl_user_and_removes_its_keys(valkey_server,
                                                                                       monkeypatch):
    """A tenant's ACL user (keys `{key_prefix}:*` only) can run the CPU<->REMOTE hop bench; afterwards
    nothing of it is left on the server, and no key outside the tenant's prefix was written."""
    import time

    from kvtier.bench.hops_runner import remote_rows
    from kvtier.config import load_config_text

    prefix = f"kvt:benchtenant{time.monotonic_ns()}"
    user = f"bench-{time.monotonic_ns()}"
    valkey_server.add_acl_user(user, "BenchTenantPW1", prefix)
    monkeypatch.setenv("KVT_BENCH_TENANT_PW", "BenchTenantPW1")
    admin = valkey_server.client()
    before = admin.dbsize()
    config = load_config_text(f"""
tiers:
  - {{name: cpu, backend: memory, capacity: 8 blocks}}
  - {{name: shared, backend: valkey, capacity: 64 blocks, url: '{valkey_server.url}', timeout_ms: 2000,
      threads: 2, key_prefix: '{prefix}', username: {user}, password_env: KVT_BENCH_TENANT_PW}}
""")
    rows = remote_rows(config, [64 << 10], 1 << 20, None)
    assert [r["hop"] for r in rows] == ["CPU->REMOTE", "REMOTE->CPU"]
    assert rows[0]["cleanup_error"] == "" and rows[0]["removed_keys"] == 2 * (1 << 20) // (64 << 10)
    assert list(admin.scan_iter(match=f"{prefix}:*")) == [] and admin.dbsize() == before
