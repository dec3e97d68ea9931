"""Which mount holds a path (`filesystem_of`, from /proc/mounts), and whether it is a kernel or
pseudo filesystem (/proc, /sys, ...) where no file tier can live (`kernel_filesystem_problem`)."""

from __future__ import annotations

import os

# Kernel and pseudo filesystems: no file tier can live there, and a figure measured there means nothing.
SPECIAL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
    "pstore", "bpf", "configfs", "fusectl", "mqueue", "efivarfs", "binfmt_misc", "autofs", "rpc_pipefs",
    "nsfs", "hugetlbfs"})


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash in paths as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_of(path: str, mounts_file: str = "/proc/mounts") -> dict[str, str | None]:
    """The mount holding `path`: `fstype`, `mount_point`, `device` (the longest mount point that is
    a prefix of its real path; the last such line wins, as the kernel stacks mounts). All None
    where /proc/mounts cannot be read."""
    real = os.path.realpath(path)
    best: dict[str, str | None] = {"fstype": None, "mount_point": None, "device": None}
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    best_len = -1
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = _unescape(fields[1])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best_len:
            best_len = len(mount)
            best = {"fstype": fields[2], "mount_point": mount, "device": _unescape(fields[0])}
    return best


def kernel_filesystem_problem(path: str) -> str | None:
    """Why no file tier can live at `path` (missing or not), when the mount holding it is a kernel
    or pseudo filesystem; None otherwise (or where /proc/mounts cannot be read)."""
    fs = filesystem_of(path)
    if fs["fstype"] not in SPECIAL_FILESYSTEMS:
        return None
    return f"on a {fs['fstype']} filesystem ({fs['mount_point']}), a kernel interface where no file tier can live"
