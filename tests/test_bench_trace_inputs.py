"""Inputs of `kvtier bench trace`: session inference reads a partial last block with the config's
block_tokens (before: always 512), and --capacities / --policies refuse a repeated value (before:
repeated rows) and a capacity that is not a whole number of blocks (before: '1.9' ran at 1 block)."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.replay import parse_counts
from kvtier.bench.sessions import load_session_trace
from kvtier.cli.main import main


def _trace_256(tmp_path):
    """Two requests of 256-token blocks: the first of 3 full blocks (768 tokens), the second shares
    its first two blocks only. With 256 tokens a block, the first's last full block is its third,
    which the second lacks: two sessions. (Read as 512-token blocks the first's last block would be
    partial, its second the last full one, and the second request would continue its session.)"""
    path = tmp_path / "t256.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 768, "hash_ids": [1, 2, 3]}) + "\n"
                    + json.dumps({"timestamp": 1000, "input_length": 700, "hash_ids": [1, 2, 9]}) + "\n")
    return path


def test_session_inference_uses_the_block_size_given(tmp_path):
    path = _trace_256(tmp_path)
    assert len(set(load_session_trace(path, block_tokens=256).sessions)) == 2
    assert len(set(load_session_trace(path).sessions)) == 1  # Mooncake's 512 tokens by default
    assert load_session_trace(path, block_tokens=256).block_tokens == 256


def test_the_bench_infers_sessions_with_the_configs_block_tokens(tmp_path):
    config = tmp_path / "bt256.yaml"
    config.write_text("block_tokens: 256\ntiers:\n  - {name: cpu, backend: memory, capacity: 100 blocks, "
                      "policy: lru}\n")
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--trace", str(_trace_256(tmp_path)), "--config", str(config), "--hints", "on",
                 "--capacities", "10", "--json", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["trace"]["sessions"]["sessions"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--capacities", "100,100"], "--capacities: 100 is given twice; give each value once"),
    (["--capacities", "100,0.1k"], "--capacities: 100 is given twice ('100' and '0.1k'); give each value once"),
    (["--policies", "lru,arc,lru"], "--policies: 'lru' is given twice; give each value once"),
    (["--capacities", "1.9"], "--capacities: '1.9' is not a whole number of blocks: write 1 or 2"),
    (["--capacities", "0.5"], "--capacities: '0.5' is not a whole number of blocks: write 1"),
    (["--capacities", "100,1.0005k"], "--capacities: '1.0005k' is not a whole number of blocks (1000.5 blocks): "
                                      "write 1,000 or 1,001"),
])
def test_repeated_and_fractional_values_are_refused_up_front(capsys, monkeypatch, argv, message):
    monkeypatch.setattr("kvtier.cli.bench.load_config", lambda path: pytest.fail("the config was read first"))
    assert main(["bench", "trace", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_whole_counts_are_read_exactly():
    assert parse_counts("1.001k,0.5k,1e3,2.5m") == [1001, 500, 1000, 2_500_000]  # 1.001k: not 1000 (float)
