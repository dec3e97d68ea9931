"""scripts/gpu_check.sh's parts that run without a GPU: its one screen (targets, figures, PASS or
FAIL from the JSON the benchmarks write), the worker check on CPU tensors, and the script's
"no CUDA" exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check_summary as summary  # noqa: E402

KIB = 1 << 10


def copy_row(page: int, d2h: float, h2d: float, both: float, **extra) -> dict:
    return {"page": page, "slots": "scattered", "mode": "auto", "path": "cudaMemcpyBatchAsync",
            "d2h_gbps": 55 * d2h, "h2d_gbps": 55 * h2d, "d2h_ratio": d2h, "h2d_ratio": h2d,
            "both_gbps": 55 * both, "both_ratio": both, **extra}


def write_out(tmp_path, rows, plan_us=5.0, worker_ok=True, steps="build ok 20\ngpu-tests ok 16\n") -> str:
    copy = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0", "contiguous_d2h_gbps": 55.0,
            "contiguous_h2d_gbps": 55.0, "contiguous_both_gbps": 98.0, "rows": rows,
            "copy_choice": {"cuda:0 pages [65536]": {"chosen": "cudaMemcpyBatchAsync", "left_out": [], "timings": {
                "cudaMemcpyBatchAsync": {"d2h_gbps": 53.0, "h2d_gbps": 52.0, "bytes": 1},
                "cudaMemcpyAsync loop": {"d2h_gbps": 40.0, "h2d_gbps": 41.0, "bytes": 1}}}}}
    plan = {"rows": [{"page": 64 * KIB, "layers": 1, "blocks": 256, "slots": "scattered", "compiled": True,
                      "compiled_us": plan_us, "reference_us": 103.0}]}
    worker = {"api": "standalone", "no_vllm": "vllm.v1.kv_offload does not import here",
              "rows": [{"check": "standalone worker corrupted block", "ok": worker_ok, "seen": "x"}]}
    for name, doc in (("gpu_copy.json", copy), ("plan.json", plan), ("worker.json", worker)):
        (tmp_path / name).write_text(json.dumps(doc))
    (tmp_path / "steps.txt").write_text(steps)
    return str(tmp_path)


def test_the_screen_passes_only_when_every_target_is_met(tmp_path, capsys):
    rows = [copy_row(64 * KIB, 0.95, 0.93, 1.62), copy_row(256 * KIB, 0.97, 0.96, 1.70),
            copy_row(2048 * KIB, 0.99, 0.98, 1.75)]
    assert summary.main([write_out(tmp_path, rows)]) == 0
    out = capsys.readouterr().out
    assert "kvtier GPU check: NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0" in out
    assert "chosen on cuda:0 pages [65536]: cudaMemcpyBatchAsync (GB/s D2H/H2D: cudaMemcpyBatchAsync 53/52, " \
           "cudaMemcpyAsync loop 40/41)" in out
    assert "scattered store, 64 KiB pages (cudaMemcpyBatchAsync)" in out and "95% (52.2 GB/s)" in out
    assert "both directions at once, 2 MiB pages" in out and "1.75x (96.2 GB/s)" in out
    assert "planning a 256-block job (this CPU)" in out and "5.0 us (was 103)" in out
    assert "kvtier's standalone API" in out
    assert "13 of 13 passed" in out and "FAIL" not in out


@pytest.mark.parametrize("case", ["ratio", "both", "missing-page", "row-error", "plan", "worker", "step"])
def test_any_missed_target_or_failed_step_fails_the_screen(tmp_path, capsys, case):
    rows = [copy_row(64 * KIB, 0.95, 0.93, 1.62), copy_row(256 * KIB, 0.97, 0.96, 1.70),
            copy_row(2048 * KIB, 0.99, 0.98, 1.75)]
    kwargs: dict = {}
    if case == "ratio":
        rows[1] = copy_row(256 * KIB, 0.97, 0.69, 1.70)
    elif case == "both":
        rows[0] = copy_row(64 * KIB, 0.95, 0.93, 1.2)
    elif case == "missing-page":
        rows.pop()
    elif case == "row-error":
        rows[2] = {"page": 2048 * KIB, "slots": "scattered", "mode": "auto", "error": "RuntimeError: boom"}
    elif case == "plan":
        kwargs["plan_us"] = 51.0
    elif case == "worker":
        kwargs["worker_ok"] = False
    else:
        kwargs["steps"] = "build ok 20\ngpu-tests FAILED 16\n"
    assert summary.main([write_out(tmp_path, rows, **kwargs)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out.splitlines()[-1] and "FAIL" in out


def test_with_nothing_measured_every_target_fails(tmp_path, capsys):
    assert summary.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") >= 11 and "steps.txt missing" in out


def test_the_worker_check_runs_on_cpu_tensors_through_the_standalone_api(tmp_path):
    """The script's own logic; on a GPU machine gpu_check.sh runs it with --device cuda."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "worker.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_worker.py"), "--device", "cpu",
                           "--api", "standalone", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["ok"] for r in rows] == [True] * 3 and len(rows) == 3
    assert "its KV untouched" in rows[2]["seen"]


def test_without_cuda_the_check_says_no_cuda_and_exits_3(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():  # (it would run the whole check, these tests included, for real)
        pytest.skip("this machine has CUDA: gpu_check.sh is run by hand here, not from the tests")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 3 and done.stdout.startswith("no CUDA:"), done.stdout
    assert not (tmp_path / "out" / "steps.txt").exists()  # nothing was run
