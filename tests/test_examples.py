"""The runnable examples of the README run, and stay the size of what they do (issue 36.12: on
7e6c7c1 `examples/restart.py` preallocated a 4.2 GB slab for its 40 blocks of 128 KiB)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / name), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_restart_finds_every_block_with_a_slab_the_size_of_its_use(tmp_path):
    out = run_example("restart.py", str(tmp_path / "nvme"))
    assert "restart: file tier recovered 40 blocks; loaded 40/40, bytes identical: True" in out
    slab = (tmp_path / "nvme" / "slab.0").stat().st_size
    assert slab <= 16 << 20, f"a slab of {slab} bytes for 40 blocks of 128 KiB"


def test_standalone_runs():
    assert run_example("standalone.py").strip()
