"""scripts/bench_vllm.py's turn-taking schedule: both engines serve every request, one at a time.

Simulates the two engines as processes (the barriers tell engines apart by pid) that play their
step lists against the bench's own file barriers (no engine): a request of one engine never
overlaps the other's, the engine going first alternates, and each engine still serves every
request in its order.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import bench_vllm  # noqa: E402
from vllm_runner import barrier  # noqa: E402

PROMPTS = {"A": "a", "B": "b", "C": "c"}


def _play(steps: list[dict], who: str, log_path: str) -> None:
    with open(log_path, "w") as log:
        for step in steps:
            if step["op"] == "barrier":
                barrier(step["dir"], step["name"], step["parties"], timeout=60)
            elif step["op"] == "generate":
                start = time.monotonic()  # system-wide clock: comparable across the two processes
                time.sleep(0.01)
                log.write(json.dumps([start, time.monotonic(), who, step["name"]]) + "\n")


def test_engines_take_turns_and_alternate(tmp_path):
    steps = bench_vllm.request_steps(PROMPTS, rounds=2, recompute=False)
    plans = {who: bench_vllm.in_turns(steps, str(tmp_path / "barriers"), position)
             for position, who in enumerate("kv")}
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_play, args=(plan, who, str(tmp_path / who))) for who, plan in plans.items()]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    log = sorted(json.loads(line) for who in "kv" for line in (tmp_path / who).read_text().splitlines())
    names = [s["name"] for s in steps if s["op"] == "generate"]
    for who in "kv":  # every request served, in order, with the resets where they were
        assert [name for _s, _e, w, name in log if w == who] == names
        assert [s["op"] for s in plans[who] if s["op"] != "barrier"] == [s["op"] for s in steps]
    for (_s, end, _w, _n), (start, _e, _w2, _n2) in zip(log, log[1:]):
        assert end <= start  # one request at a time
    # request i by both engines back to back, the engine going first alternating
    assert [(w, n) for _s, _e, w, n in log[::2]] == [("kv"[i % 2], n) for i, n in enumerate(names)]
    assert [(w, n) for _s, _e, w, n in log[1::2]] == [("kv"[(i + 1) % 2], n) for i, n in enumerate(names)]
