"""Load a stand-in `libcuda.so.1` (kvtier/testing/fake_libcuda.c) so kvikio's host-memory path
works on machines without an NVIDIA driver (tests, CPU-only CI).

Call `load_fake_libcuda()` before kvikio's first I/O. It does nothing when a real driver library
can be loaded, so tests may call it unconditionally.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
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
