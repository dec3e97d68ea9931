"""The Triton copy kernel (`kvtier.transfer.handlers.copy_kernel`) on CPU: Triton's interpreter runs it on
host memory (in a child process: `TRITON_INTERPRET` is read when a kernel is defined), through
the same self-check a GPU runs; and when it is offered at all."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_copy_choice import fake_timer, named
from test_fast_path import host_check

from kvtier.transfer.handlers import copy_kernel, fast_path
from kvtier.transfer.handlers.cuda_copy import Unavailable

ROOT = Path(__file__).resolve().parents[2]

INTERPRETED = """
import numpy as np, torch
from kvtier.transfer.handlers import fast_path
from kvtier.transfer.handlers.copy_kernel import KernelSubmitter, copy_kernel
from kvtier.transfer.handlers.copy_plan import CopyPlan

kernel = KernelSubmitter(copy_kernel(), programs=4)
n = fast_path.PROBE_PAGE * fast_path.PROBE_PAGES
fast_path.check_round_trip(kernel, torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8), 0,
                           lambda: None)  # 8-byte words, scattered pages, both ways
src, dst = torch.randint(1, 256, (1000,), dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)
odd = CopyPlan(np.array([src.data_ptr() + 3, src.data_ptr() + 500]), np.array([dst.data_ptr() + 1,
               dst.data_ptr() + 600]), np.array([101, 333]))
kernel.submit(odd, 0)  # the byte-wide variant
assert torch.equal(dst[1:102], src[3:104]) and torch.equal(dst[600:933], src[500:833])
assert int(dst[102:600].sum()) == 0 and int(dst[0]) == 0 and int(dst[933:].sum()) == 0
kernel.submit(CopyPlan(*(np.zeros(0, dtype=np.int64),) * 3), 0)
print("kernel ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_kernel_passes_the_self_check_and_copies_unaligned_runs_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stdout + done.stderr


def test_the_kernel_is_offered_only_where_the_device_reads_registered_host_memory(monkeypatch):
    class Cudart:
        def __init__(self, value, code=0):
            self.value, self.code, self.asked = value, code, []

        def cudaDeviceGetAttribute(self, out, attribute, device):
            self.asked.append((attribute, device))
            ctypes.cast(out, ctypes.POINTER(ctypes.c_int)).contents.value = self.value
            return self.code

    yes = Cudart(1)
    assert copy_kernel.host_pointers_usable(yes, 3) and yes.asked == [(91, 3)]
    assert not copy_kernel.host_pointers_usable(Cudart(0), 0)
    assert not copy_kernel.host_pointers_usable(Cudart(1, code=101), 0)  # the query failed

    def no_triton():
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(copy_kernel, "copy_kernel", no_triton)
    with pytest.raises(Unavailable, match="Triton does not import"):
        copy_kernel.make_kernel_submitter()


def test_a_mechanism_not_available_here_is_named_at_info_not_warned_about(caplog):
    def absent():
        raise Unavailable("Triton does not import (No module named 'triton')")

    choice = fast_path.FastPathChoice()
    timer = fake_timer({"batch": 0.002})
    with caplog.at_level(logging.INFO, logger="kvtier.transfer.handlers.fast_path"):
        chosen = choice.get("cuda:0", [("batch", named("batch")), ("kernel", absent)], host_check, timer)
    assert chosen.name == "batch"
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.getMessage().endswith(
        "batch (measured here: batch: D2H 16.8 GB/s, H2D 16.8 GB/s; not available here: kernel: Triton does not "
        "import (No module named 'triton'))")


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvtier.transfer.handlers.copy_kernel import WORDS, copy_kernel

kernel = copy_kernel()
for wide in (True, False):
    source = ASTSource(fn=kernel, signature={"descs": "*i64", "n": "i32", "WORDS": "constexpr", "WIDE": "constexpr"},
                       constexprs={"WORDS": WORDS, "WIDE": wide})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))  # an H100/H200, no GPU needed
    assert len(compiled.asm["cubin"]) > 1000 and "ld.global" in compiled.asm["ptx"]
print("compiled for sm_90")
"""


def _has_cuda_backend() -> bool:
    return (importlib.util.find_spec("triton") is not None
            and importlib.util.find_spec("triton.backends.nvidia") is not None)


@pytest.mark.skipif(not _has_cuda_backend(), reason="Triton (with its CUDA backend) is not installed")
def test_the_kernel_compiles_for_an_h100_without_a_gpu():
    """What the interpreter does not check: the kernel type-checks and lowers to sm_90 machine code."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled for sm_90" in done.stdout, done.stdout + done.stderr[-2000:]
