"""Does a configured capacity fit the machine? Checked when a hierarchy is built, before any
memory is mapped or any slab file is allocated, so a typo such as `64TiB` fails with the field's
path instead of an out-of-memory kill or a full disk."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.tiers.cpu import backend as cpu
from kvtier.units import format_size


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_space(path: str | Path) -> int | None:
    """Free bytes (for unprivileged users) on the filesystem holding `path` or its nearest parent."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _bytes_under(path: Path) -> int:
    """Bytes already allocated under a directory (a reopened tier reuses its slab)."""
    if not path.is_dir():
        return 0
    total = 0
    for entry in path.iterdir():
        try:
            if entry.is_file():
                total += entry.stat().st_blocks * 512
        except OSError:
            continue
    return total


def capacity_problem(backend: str, medium: str, need: int, options: dict) -> str | None:
    """Why `need` bytes of a `backend` tier cannot fit here, or None if they can (or nobody knows)."""
    if medium == "CPU" and backend in ("cpu", "memory"):
        limits = []
        mem = available_memory()
        if mem is not None:
            limits.append((mem, "available memory"))
        if backend == "cpu":
            shm = free_space(cpu.SHM_DIR)
            if shm is not None:
                limits.append((shm, f"free space in {cpu.SHM_DIR}"))
        for limit, what in limits:
            if need > limit:
                return f"{format_size(need)} is more than the {what} ({format_size(limit)}); lower the capacity"
    root = options.get("root_dir")
    if medium == "FILE" and root:
        free = free_space(root)
        if free is not None and need > free + _bytes_under(Path(root)):
            return (f"{format_size(need)} does not fit on the filesystem of {root} "
                    f"({format_size(free)} free); lower the capacity or choose another root_dir")
    return None
