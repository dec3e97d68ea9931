"""The thin CUDA layer: submit a whole `CopyPlan` on a stream in one call.

Two submitters, tried in this order by `kvtier.handlers.fast_path` (each must pass its
self-check before a job uses it):

- `BatchSubmitter`: one `cudaMemcpyBatchAsync` for all descriptors, through `cuda.bindings.runtime`
  (CUDA >= 12.8). The CUDA 12.8/12.9 binding returns `(err, failIdx)`, the CUDA 13 one `(err,)`;
  both are read by length. One attribute (source access order: stream) applies to every
  descriptor. It fails with `cudaErrorInvalidValue` on the legacy default stream: callers pass
  the handler's own stream.
- `LoopSubmitter`: the compiled loop of `cudaMemcpyAsync` (`kvtier.handlers._memcpy_loop`) over
  the plan's arrays, with `cudaMemcpyDefault` (direction from the addresses; the host side is
  pinned). `cudaMemcpyAsync` is looked up in the libcudart the process has loaded (torch's), so
  nothing here needs CUDA headers.

A submitter raises `CopyError` naming the CUDA error and the descriptor; descriptors before it
may have been submitted (the job fails; a load's engine blocks are then not to be trusted, as
with any failed load).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Protocol

from kvtier.handlers.copy_plan import CopyPlan

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyKind: direction inferred from the pointers (unified addressing)
BATCH_MIN_RUNTIME = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8


class CopyError(RuntimeError):
    """A CUDA copy call failed (the message names the call, the error and the descriptor)."""


class Submitter(Protocol):
    """Submits every descriptor of a plan on `stream` (a `cudaStream_t` as an int); the copies
    are complete once the stream reaches the point after the call."""

    name: str

    def submit(self, plan: CopyPlan, stream: int) -> None: ...


class LoopSubmitter:
    """A compiled loop of calls to the function at address `function`, which has the C signature
    of `cudaMemcpyAsync` (`int (void *dst, const void *src, size_t n, int kind, void *stream)`)."""

    name = "cudaMemcpyAsync loop"

    def __init__(self, function: int, kind: int = CUDA_MEMCPY_DEFAULT):
        from kvtier.handlers import _memcpy_loop  # ImportError where the extension was not built

        self._submit = _memcpy_loop.submit_copies
        self.function, self.kind = int(function), kind

    def submit(self, plan: CopyPlan, stream: int) -> None:
        code, done = self._submit(self.function, plan.dst, plan.src, plan.size, self.kind, int(stream))
        if code != 0:
            raise CopyError(f"cudaMemcpyAsync returned error {code} at descriptor {done} of {len(plan)} "
                            f"({int(plan.size[done])} B from {int(plan.src[done]):#x} to {int(plan.dst[done]):#x})")


class BatchSubmitter:
    """All descriptors of a plan in one `cudaMemcpyBatchAsync` (`runtime` = `cuda.bindings.runtime`)."""

    name = "cudaMemcpyBatchAsync"

    def __init__(self, runtime: Any):
        self.rt = runtime
        attrs = runtime.cudaMemcpyAttributes()
        attrs.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self.attrs = attrs

    def submit(self, plan: CopyPlan, stream: int) -> None:
        n = len(plan)
        if n == 0:
            return
        result = self.rt.cudaMemcpyBatchAsync(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist(), n,
                                              [self.attrs], [0], 1, int(stream))
        err = result[0]
        if err != self.rt.cudaError_t.cudaSuccess:
            where = f" at descriptor {result[1]}" if len(result) > 1 else ""
            raise CopyError(f"cudaMemcpyBatchAsync of {n} descriptors returned {err!r}{where}")


def loaded_cudart() -> ctypes.CDLL:
    """The CUDA runtime library: the one this process already mapped (torch's), else the first of
    the usual sonames that loads. OSError naming what was tried otherwise."""
    tried = []
    for path in [*_mapped("libcudart.so"), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
    raise OSError("no CUDA runtime library (libcudart) could be loaded: " + "; ".join(tried))


def _mapped(stem: str) -> list[str]:
    """Paths of the shared objects named `stem*` mapped into this process (Linux)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = {line.split()[-1] for line in maps if stem in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(stem))


def make_loop_submitter() -> LoopSubmitter:
    """A `LoopSubmitter` over this process's `cudaMemcpyAsync`."""
    address = ctypes.cast(loaded_cudart().cudaMemcpyAsync, ctypes.c_void_p).value
    return LoopSubmitter(address or 0)


def make_batch_submitter() -> BatchSubmitter:
    """A `BatchSubmitter`, or an exception saying why there is none here (no cuda-bindings, a
    runtime binding or a driver older than 12.8)."""
    from cuda.bindings import runtime  # ImportError without cuda-bindings

    for what, call in (("runtime", runtime.cudaRuntimeGetVersion), ("driver", runtime.cudaDriverGetVersion)):
        err, version = call()
        if err != runtime.cudaError_t.cudaSuccess:
            raise CopyError(f"cuda{what.title()}GetVersion returned {err!r}")
        if version < BATCH_MIN_RUNTIME:
            raise CopyError(f"CUDA {what} {version // 1000}.{version % 1000 // 10} has no cudaMemcpyBatchAsync "
                            f"(needs 12.8)")
    if not hasattr(runtime, "cudaMemcpyBatchAsync"):
        raise CopyError("cuda.bindings.runtime has no cudaMemcpyBatchAsync (needs cuda-bindings >= 12.8)")
    return BatchSubmitter(runtime)
