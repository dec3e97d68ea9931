"""A config's `store_threshold` is replayed by `kvtier bench trace`, in kvtier's rows (as its vLLM
adapter applies it) and in vLLM's (its own `store_threshold`): before, the replay dropped it and
replayed another cache than the one configured."""

from __future__ import annotations

import json

import pytest

from kvtier.bench import replay, workloads
from kvtier.cli.main import main
from kvtier.config import parse_config


def _config(threshold: int):
    return parse_config({"store_threshold": threshold, "block_tokens": 512,
                         "tiers": [{"name": "cpu", "backend": "memory", "capacity": "300 blocks", "policy": "lru"}]})


def _trace():
    return workloads.generate_trace(num_conversations=60)


def test_kvtier_rows_apply_the_threshold():
    trace = _trace()
    plain = replay.replay_kvtier(_config(0), trace)
    filtered = replay.replay_kvtier(_config(2), trace)
    assert "stores_skipped" not in plain
    assert filtered["stores_skipped"] > 0
    assert filtered["hit_rate"] != plain["hit_rate"]


def test_vllm_rows_apply_the_threshold():
    pytest.importorskip("vllm")
    trace = _trace()
    assert replay.replay_vllm(300, "lru", trace, store_threshold=2)["hit_rate"] != \
        replay.replay_vllm(300, "lru", trace)["hit_rate"]


def test_the_command_replays_the_configs_threshold(tmp_path):
    pytest.importorskip("vllm")
    config = tmp_path / "t.yaml"
    config.write_text("store_threshold: 2\nblock_tokens: 512\n"
                      "tiers:\n  - {name: cpu, backend: memory, capacity: 300 blocks, policy: lru}\n")
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--quick", "--no-progress", "--config", str(config), "--trace", "sample",
                 "--limit", "300", "--capacities", "100", "--compare", "vllm", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["trace"]["runs"]
    ours = [r for r in runs if r["system"] == "kvtier"]
    assert ours and all(r["stores_skipped"] > 0 for r in ours)
    theirs = {r["policy"]: r["hit_rate"] for r in runs if r["system"] == "vllm"}
    expected = replay.replay_vllm(100, "lru", workloads.load_trace(replay_sample(), 300), store_threshold=2)
    assert theirs["lru"] == expected["hit_rate"]


def replay_sample():
    from kvtier.bench.sample import sample_trace_path

    return sample_trace_path()
