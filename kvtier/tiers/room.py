"""Room on this machine for a tier: available memory, free space of a filesystem, and the messages
of the capacity rules that compare a tier's bytes with them.

Each backend states its own rule (`Backend.capacity_problem`: the CPU tier, memory and its shm
directory; the memory tier, memory; the file tier, the free space of its root_dir); the build and
`kvtier config check` ask the backend class, before any memory is mapped or any slab file is
allocated, so a typo such as `64TiB` fails with the field's path instead of an out-of-memory kill
or a full disk.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.core.units import format_size


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


def memory_problem(need: int, shm_dir: str | None = None) -> str | None:
    """Why `need` bytes of host memory cannot be had here: more than the available memory or, with
    `shm_dir`, than the free space there (a shared-memory region is a file in it); None if they fit
    or nobody knows."""
    limits = []
    mem = available_memory()
    if mem is not None:
        limits.append((mem, "available memory"))
    if shm_dir is not None:
        shm = free_space(shm_dir)
        if shm is not None:
            limits.append((shm, f"free space in {shm_dir}"))
    for limit, what in limits:
        if need > limit:
            return f"{format_size(need)} is more than the {what} ({format_size(limit)}); lower the capacity"
    return None


def disk_problem(need: int, root_dir: str | None) -> str | None:
    """Why `need` bytes cannot be allocated under `root_dir` (its filesystem's free space plus what
    the directory already holds: a reopened tier reuses its files); None if they fit, nobody knows,
    or no root_dir is given."""
    if not root_dir:
        return None
    free = free_space(root_dir)
    if free is not None and need > free + _bytes_under(Path(root_dir)):
        return (f"{format_size(need)} does not fit on the filesystem of {root_dir} "
                f"({format_size(free)} free); lower the capacity or choose another root_dir")
    return None
