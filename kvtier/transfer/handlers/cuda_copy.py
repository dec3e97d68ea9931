"""The thin CUDA layer: submit a whole `CopyPlan` on a stream in one call.

Three submitters here (and a Triton copy kernel, `kvtier.transfer.handlers.copy_kernel`), each
self-checked and timed by `kvtier.transfer.handlers.fast_path`, which takes the fastest:

- `CBatchSubmitter`: one `cudaMemcpyBatchAsync` (CUDA >= 12.8) called through ctypes in the
  libcudart the process already loaded (torch's), on the plan's int64 arrays as they are (no
  per-descriptor Python work). The CUDA 12.8/12.9 prototype has a `failIdx` out-parameter before
  the stream, the CUDA 13 one has none: which one is taken from `cudaRuntimeGetVersion`. One
  attribute (source access order: stream) applies to every descriptor.
- `BatchSubmitter`: the same call through `cuda.bindings.runtime` (lists built per call, about
  1 us per descriptor); the 12.8/12.9 binding returns `(err, failIdx)`, the CUDA 13 one `(err,)`.
- `LoopSubmitter`: the compiled loop of `cudaMemcpyAsync` (`kvtier.transfer.handlers._memcpy_loop`) over
  the plan's arrays, with `cudaMemcpyDefault` (direction from the addresses).

`cudaMemcpyBatchAsync` fails with `cudaErrorInvalidValue` on the legacy default stream: callers
pass the handler's own stream. Nothing here needs CUDA headers. A submitter raises `CopyError`
naming the CUDA error (and the descriptor where CUDA says); descriptors before it may have been
submitted (the job fails; a load's engine blocks are then not to be trusted, as with any failed
load).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Protocol

from kvtier.transfer.handlers.copy_plan import CopyPlan

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyKind: direction inferred from the pointers (unified addressing)
BATCH_MIN_RUNTIME = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
NO_FAIL_INDEX_RUNTIME = 13000  # CUDA 13 dropped its failIdx parameter
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
SRC_ACCESS_ORDER_ANY = 3  # cudaMemcpySrcAccessOrderAny: the sources stay unchanged until the copy ends
ATTRIBUTES_WORDS = 16  # a zeroed cudaMemcpyAttributes (24 B: order, two cudaMemLocation, flags), padded


class CopyError(RuntimeError):
    """A CUDA copy call failed (the message names the call, the error and the descriptor)."""


class Unavailable(CopyError):
    """A copy mechanism that does not exist here (a runtime too old, a module not installed):
    nothing failed, there is nothing to try."""


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
        from kvtier.transfer.handlers import _memcpy_loop  # ImportError where the extension was not built

        self._submit = _memcpy_loop.submit_copies
        self.function, self.kind = int(function), kind

    def submit(self, plan: CopyPlan, stream: int) -> None:
        code, done = self._submit(self.function, plan.dst, plan.src, plan.size, self.kind, int(stream))
        if code != 0:
            raise CopyError(f"cudaMemcpyAsync returned error {code} at descriptor {done} of {len(plan)} "
                            f"({int(plan.size[done])} B from {int(plan.src[done]):#x} to {int(plan.dst[done]):#x})")


class CBatchSubmitter:
    """All descriptors of a plan in one call of `function`, a ctypes function with the C
    prototype of `cudaMemcpyBatchAsync` (`with_fail_index`: the CUDA 12.8/12.9 one, which takes a
    `size_t *failIdx` before the stream). `src_access_order` is every descriptor's
    `cudaMemcpySrcAccessOrder` (stream order: the sources are read in stream order)."""

    name = "cudaMemcpyBatchAsync"

    def __init__(self, function: Any, with_fail_index: bool, src_access_order: int = SRC_ACCESS_ORDER_STREAM):
        self.function, self.with_fail_index = function, with_fail_index
        self._attrs = (ctypes.c_uint32 * ATTRIBUTES_WORDS)()
        self._attrs[0] = src_access_order
        self._attr_index = (ctypes.c_size_t * 1)(0)

    def submit(self, plan: CopyPlan, stream: int) -> None:
        import numpy as np

        n = len(plan)
        if n == 0:
            return
        dst, src, size = (np.ascontiguousarray(a, dtype=np.int64) for a in (plan.dst, plan.src, plan.size))
        args: list[Any] = [dst.ctypes.data, src.ctypes.data, size.ctypes.data, n, ctypes.addressof(self._attrs),
                           ctypes.addressof(self._attr_index), 1]
        fail = ctypes.c_size_t(n)
        if self.with_fail_index:
            args.append(ctypes.addressof(fail))
        code = self.function(*args, int(stream))
        if code != 0:
            where = f" at descriptor {fail.value}" if self.with_fail_index and fail.value < n else ""
            raise CopyError(f"cudaMemcpyBatchAsync of {n} descriptors returned error {code}{where}")


def batch_prototype(with_fail_index: bool) -> Any:
    """The ctypes prototype of `cudaMemcpyBatchAsync` (12.8/12.9 with `failIdx`, 13 without)."""
    p = ctypes.c_void_p
    middle = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t] + ([p] if with_fail_index else [])
    return ctypes.CFUNCTYPE(ctypes.c_int, *middle, p)


class BatchSubmitter:
    """All descriptors of a plan in one `cudaMemcpyBatchAsync` (`runtime` = `cuda.bindings.runtime`)."""

    name = "cudaMemcpyBatchAsync (cuda.bindings)"

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
            # failIdx is SIZE_MAX when the error concerns no particular descriptor
            where = f" at descriptor {result[1]}" if len(result) > 1 and int(result[1]) < n else ""
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


def runtime_version(cudart: Any) -> int:
    """`cudaRuntimeGetVersion` of a loaded libcudart (e.g. 13000 for CUDA 13.0)."""
    version = ctypes.c_int(0)
    code = cudart.cudaRuntimeGetVersion(ctypes.byref(version))
    if code != 0:
        raise CopyError(f"cudaRuntimeGetVersion returned error {code}")
    return version.value


def make_c_batch_submitter(src_access_order: int = SRC_ACCESS_ORDER_STREAM) -> CBatchSubmitter:
    """A `CBatchSubmitter` over this process's libcudart, with the prototype of its version."""
    cudart = loaded_cudart()
    version = runtime_version(cudart)
    if version < BATCH_MIN_RUNTIME:
        raise Unavailable(f"CUDA runtime {version // 1000}.{version % 1000 // 10} has no cudaMemcpyBatchAsync "
                          f"(needs 12.8)")
    with_fail_index = version < NO_FAIL_INDEX_RUNTIME
    address = ctypes.cast(cudart.cudaMemcpyBatchAsync, ctypes.c_void_p).value
    return CBatchSubmitter(batch_prototype(with_fail_index)(address), with_fail_index, src_access_order)


def make_loop_submitter() -> LoopSubmitter:
    """A `LoopSubmitter` over this process's `cudaMemcpyAsync`."""
    address = ctypes.cast(loaded_cudart().cudaMemcpyAsync, ctypes.c_void_p).value
    return LoopSubmitter(address or 0)


def make_batch_submitter() -> BatchSubmitter:
    """A `BatchSubmitter`, or an exception saying why there is none here (no cuda-bindings, a
    runtime binding or a driver older than 12.8)."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise Unavailable(f"cuda-bindings does not import ({exc})") from None

    for what, call in (("runtime", runtime.cudaRuntimeGetVersion), ("driver", runtime.cudaDriverGetVersion)):
        err, version = call()
        if err != runtime.cudaError_t.cudaSuccess:
            raise CopyError(f"cuda{what.title()}GetVersion returned {err!r}")
        if version < BATCH_MIN_RUNTIME:
            raise Unavailable(f"CUDA {what} {version // 1000}.{version % 1000 // 10} has no cudaMemcpyBatchAsync "
                              f"(needs 12.8)")
    if not hasattr(runtime, "cudaMemcpyBatchAsync"):
        raise Unavailable("cuda.bindings.runtime has no cudaMemcpyBatchAsync (needs cuda-bindings >= 12.8)")
    return BatchSubmitter(runtime)
