"""Stand-ins for CUDA on machines without it (tests, CPU-only CI, the planning benchmark).

- `load_fake_libcuda()`: a stand-in `libcuda.so.1` (tests/support/fake_libcuda.c) so kvikio's
  host-memory path works without an NVIDIA driver. Call it before kvikio's first I/O; it does
  nothing when a real driver library can be loaded, so tests may call it unconditionally.
- `host_cuda_patches` / `patched`: torch's streams, events and device contexts as no-ops, so the
  CUDA engine <-> CPU handlers' own logic runs on host tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

_SOURCE = Path(__file__).with_name("fake_libcuda.c")
_loaded: str | None = None


def real_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def build_fake_libcuda(out_dir: str) -> str:
    """Compile the stubs into `out_dir/libcuda.so.1`; returns its path. Needs `cc` on PATH."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("building the fake libcuda needs a C compiler (cc or gcc) on PATH")
    path = os.path.join(out_dir, "libcuda.so.1")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", path, str(_SOURCE)],
                   check=True,
                   capture_output=True, text=True)
    return path


def load_fake_libcuda() -> str | None:
    """Make `libcuda.so.1` resolvable process-wide: the real one if present, else the stand-in
    (compiled once into a temporary directory). Returns the stand-in's path, or None."""
    global _loaded
    if _loaded is not None or real_driver_present():
        return _loaded
    path = build_fake_libcuda(tempfile.mkdtemp(prefix="kvtier-fake-cuda-"))
    # Loaded RTLD_GLOBAL with DT_SONAME libcuda.so.1: kvikio's later dlopen("libcuda.so.1") matches it.
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _loaded = path
    return path


class HostEvent:
    """A stand-in `torch.cuda.Event` on a machine without CUDA: recording and waiting do nothing."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HostStream:
    """A stand-in `torch.cuda.Stream`: `cuda_stream` is 0, waiting for an event does nothing."""

    cuda_stream = 0

    def __init__(self, device=None, priority: int = 0):
        self.priority = priority

    def wait_event(self, event) -> None:
        pass


def host_cuda_patches(torch) -> list[tuple[object, str, object]]:
    """`(object, attribute, value)` to set so that a CUDA handler's own logic (planning, submission,
    completion, staging) runs on host tensors: streams and events as no-ops (`HostStream`,
    `HostEvent`), device and stream contexts as null contexts, `pin_memory=True` ignored. It says
    nothing about real stream ordering: that is what the `gpu` tests are for. Apply them with
    pytest's `monkeypatch.setattr(*patch)`, or `patched(torch)` outside tests."""
    import contextlib

    empty = torch.empty
    return [(torch.cuda, "Event", HostEvent), (torch.cuda, "Stream", HostStream),
            (torch.cuda, "current_stream", lambda device=None: HostStream()),
            (torch.cuda, "device", lambda device: contextlib.nullcontext()),
            (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
            (torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))]


@contextlib.contextmanager
def patched(torch) -> Iterator[None]:
    """`host_cuda_patches(torch)` applied for the duration of the block (benchmarks, scripts)."""
    patches = host_cuda_patches(torch)
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
