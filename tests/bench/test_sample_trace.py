"""The sample trace shipped in the package, usable as `bench trace --trace sample`."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import tomllib

from kvtier.bench.sample import sample_trace_path
from kvtier.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_sample_is_small_packaged_and_a_mooncake_trace():
    path = sample_trace_path()
    assert path.stat().st_size < 200_000
    lines = path.read_text().splitlines()
    assert 300 <= len(lines) and all(isinstance(json.loads(line)["hash_ids"], list) for line in lines)
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvtier"]
    relative = path.relative_to(ROOT / "kvtier").as_posix()
    assert any(fnmatch.fnmatch(relative, p) for p in patterns), (relative, patterns)


def test_bench_trace_replays_the_sample_by_name(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["bench", "trace", "--trace", "sample", "--config", "configs/memory.yaml", "--capacities", "500",
            "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["trace"]["trace"] == "mooncake_conversation_sample.jsonl" and doc["trace"]["requests"] == 600
    assert 0 < doc["trace"]["runs"][0]["hit_rate"] < 1


def test_help_says_where_traces_come_from(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "trace", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "Mooncake project" in text and "--trace sample" in text and "http" not in text
