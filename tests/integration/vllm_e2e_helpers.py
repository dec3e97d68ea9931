"""Helpers for the vLLM end-to-end tests: run `vllm_runner.py` in a subprocess and read its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_runner.py"


def run_engine(job: dict, workdir: Path, name: str, timeout: float = 300) -> dict:
    """Run one engine process over `job` (see vllm_runner.py); returns its report.

    Raises AssertionError with the tail of the engine's log when the process fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, report_path, log_path = (workdir / f"{name}.job.json", workdir / f"{name}.report.json",
                                       workdir / f"{name}.log")
    job_path.write_text(json.dumps(job))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[1]), str(HERE), env.get("PYTHONPATH")]))
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(RUNNER), str(job_path), str(report_path)], stdout=log,
                              stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0 or not report_path.exists():
        tail = "\n".join(log_path.read_text().splitlines()[-60:])
        raise AssertionError(f"engine process {name} failed (rc={proc.returncode}); log tail:\n{tail}")
    return json.loads(report_path.read_text())


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
