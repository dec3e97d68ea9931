"""The `kvtier` command: exit codes, JSON schema, clear errors without tracebacks."""

import json
import subprocess
import sys

import pytest

from kvtier.cli.main import main

MEMORY = "configs/memory.yaml"


def run(*args):
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], capture_output=True, text=True, timeout=300)


def test_config_check_prints_the_resolved_hierarchy(capsys):
    assert main(["config", "check", MEMORY]) == 0
    out = capsys.readouterr().out
    assert "[0] hot: backend=memory" in out and "1024 blocks" in out and "cascade on_evict to warm" in out


def test_config_check_lists_errors_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {name: cpu, backend: memory, capacity: 64GB}\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "tiers[0].capacity" in capsys.readouterr().err


def test_bench_trace_writes_the_documented_json(tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--config", MEMORY, "--quick", "--capacities", "100,400", "--policies", "lru,arc",
                 "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kvtier.bench/1"
    assert {"machine", "versions", "config", "trace", "summary", "created"} <= set(doc)
    runs = doc["trace"]["runs"]
    assert [(r["policy"], r["capacity_blocks"]) for r in runs] == [("lru", 100), ("arc", 100), ("lru", 400), ("arc", 400)]
    for r in runs:
        assert 0 <= r["hit_rate"] <= doc["trace"]["optimum_hit_rate"] + 1e-9 and r["block_ops_per_s"] > 0
        assert set(r["tiers"]) == {"hot", "warm"}
    # The offline optimum for the whole hierarchy (warm tier: 4096 blocks) bounds every run at its size.
    ceilings = {o["capacity_blocks"]: o for o in doc["trace"]["optimum"]}
    assert [(c, o["total_capacity_blocks"]) for c, o in sorted(ceilings.items())] == [(100, 4196), (400, 4496)]
    for r in runs:
        assert r["hit_rate"] <= ceilings[r["capacity_blocks"]]["hit_rate"] + 1e-9
    assert ceilings[100]["hit_rate"] <= ceilings[400]["hit_rate"] <= doc["trace"]["optimum_hit_rate"] + 1e-9


def test_bench_trace_replays_a_mooncake_file(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i, "hash_ids": [1, 2, 3 + i]}) for i in range(20)) + "\n")
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--config", MEMORY, "--trace", str(trace), "--json", str(out), "--no-progress"]) == 0
    run_ = json.loads(out.read_text())["trace"]["runs"][0]
    assert run_["blocks"] == 60 and run_["hit_blocks"] == 38  # blocks 1 and 2 hit in 19 requests


@pytest.mark.parametrize("args, message", [
    (["bench", "trace", "--trace", "/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
    (["bench", "trace", "--trace", "BAD"], "BAD_PATH:2: not valid JSON"),
    (["bench", "trace", "--trace", "NOHASH"], "NOHASH_PATH:1: expected an object with 'hash_ids'"),
    (["bench", "trace", "--json", "/no/such/dir/out.json"], "cannot write JSON output"),
    (["bench", "trace", "--capacities", "10k,lots"], "--capacities: 'lots' is not a block count"),
    (["bench", "trace", "--policies", "lru,nope"], "unknown policy 'nope'"),
    (["bench", "--config", "/no/such.yaml"], "cannot read config /no/such.yaml"),
])
def test_user_mistakes_give_one_message_and_exit_2(tmp_path, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1]}\n{broken\n')
    nohash = tmp_path / "nohash.jsonl"
    nohash.write_text('{"input_length": 3}\n')
    args = [str(bad) if a == "BAD" else str(nohash) if a == "NOHASH" else a for a in args]
    if "--config" not in args:
        args += ["--config", MEMORY]
    result = run(*args, "--no-progress")
    message = message.replace("BAD_PATH", str(bad)).replace("NOHASH_PATH", str(nohash))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
