"""A copy mechanism on the GPU's SMs: a Triton kernel that runs a `CopyPlan` through the pinned
region's device mapping (its host addresses, usable on the device where the driver maps
registered host memory at the same address).

One program per descriptor in turn (a grid of `PROGRAMS`, each taking every `PROGRAMS`-th
descriptor) copies it in 8-byte words, `WORDS` lanes at a time; a plan with any address or size
that is not a multiple of 8 runs the byte-wide variant of the same kernel. The descriptors go to
the device in one small non-blocking copy on the same stream, just before the kernel.
`fast_path` times it beside the DMA mechanisms and takes it only where it is faster; unlike DMA
it competes with the model for SMs, so it is last in order of preference (a tie goes to DMA).
Measured figures: docs/benchmarks.md.

Offered only where Triton imports and the device reads registered host memory at its host
address (`cudaDevAttrCanUseHostPointerForRegisteredMem`, as the CPU tier registers its region
with `cudaHostRegister`); elsewhere `make_kernel_submitter` raises `Unavailable`. Without CUDA
(the tests, under `TRITON_INTERPRET=1`) the descriptors stay on the host and Triton's
interpreter runs the kernel on host memory.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from kvtier.transfer.handlers.copy_plan import CopyPlan
from kvtier.transfer.handlers.cuda_copy import CopyError, Unavailable, loaded_cudart

PROGRAMS = 32  # few SMs taken from the model; program counts measured: docs/benchmarks.md
WORDS = 1024  # lanes per step: 8 KiB per program per step with 8-byte words
CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDeviceAttr


@functools.cache
def copy_kernel() -> Any:
    """The jitted kernel, made once per process (Triton imported here: ImportError without it;
    one function object, so that every handler shares its compiled code)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_descriptors(descs, n, WORDS: tl.constexpr, WIDE: tl.constexpr):
        i = tl.program_id(0)
        lanes = tl.arange(0, WORDS)
        while i < n:
            if WIDE:
                src = tl.load(descs + i).to(tl.pointer_type(tl.int64))
                dst = tl.load(descs + n + i).to(tl.pointer_type(tl.int64))
                count = tl.load(descs + 2 * n + i) // 8
            else:
                src = tl.load(descs + i).to(tl.pointer_type(tl.int8))
                dst = tl.load(descs + n + i).to(tl.pointer_type(tl.int8))
                count = tl.load(descs + 2 * n + i)
            for first in range(0, count, WORDS):
                at = first + lanes
                keep = at < count
                tl.store(dst + at, tl.load(src + at, mask=keep, other=0), mask=keep)
            i += tl.num_programs(0)

    return copy_descriptors


class KernelSubmitter:
    """Runs each plan with `kernel` (`copy_kernel()`) on the given stream."""

    name = "Triton copy kernel"

    def __init__(self, kernel: Any, programs: int = PROGRAMS):
        self.kernel, self.programs = kernel, programs

    def submit(self, plan: CopyPlan, stream: int) -> None:
        import torch

        n = len(plan)
        if n == 0:
            return
        on_gpu = torch.cuda.is_available()
        host = torch.empty((3, n), dtype=torch.int64, pin_memory=on_gpu)
        table = host.numpy()
        table[0], table[1], table[2] = plan.src, plan.dst, plan.size
        wide = not bool(((table[0] | table[1] | table[2]) & 7).any())
        grid = (min(n, self.programs),)
        if not on_gpu:  # Triton's interpreter (tests): host memory, host descriptors
            self.kernel[grid](host, n, WORDS=WORDS, WIDE=wide)
            return
        device = torch.cuda.current_device()
        try:
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                descs = host.to(device, non_blocking=True)  # (the pinned block is kept until this copy ran)
                self.kernel[grid](descs, n, WORDS=WORDS, WIDE=wide)
        except Exception as exc:  # a launch that fails: the handler drops this path, redoes the job staged
            raise CopyError(f"the Triton copy kernel of {n} descriptors failed to launch: "
                            f"{type(exc).__name__}: {exc}") from exc


def host_pointers_usable(cudart: Any, device: int) -> bool:
    """Whether `device` reads registered host memory at its host address."""
    value = ctypes.c_int(0)
    code = cudart.cudaDeviceGetAttribute(ctypes.byref(value), CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device)
    return code == 0 and value.value == 1


def make_kernel_submitter() -> KernelSubmitter:
    """A `KernelSubmitter` for the current CUDA device, or `Unavailable` saying why there is none."""
    try:
        kernel = copy_kernel()
    except ImportError as exc:
        raise Unavailable(f"Triton does not import ({exc})") from None
    import torch

    device = torch.cuda.current_device()
    if not host_pointers_usable(loaded_cudart(), device):
        raise Unavailable(f"cuda:{device} cannot use host pointers of registered memory")
    return KernelSubmitter(kernel)
