"""Where the file hops are measured: the directory, its filesystem, and why that one.

`check_root_dir(path)` refuses, before anything is measured or created, a `--root-dir` that does not
exist, is not a directory, cannot be written, or is on a kernel filesystem (/proc, /sys, ...) where a
file tier cannot live. `filesystem_of(path)` names the mount holding a path (from /proc/mounts).
`file_hops_place(config, root_dir)` decides where `kvtier bench hops` measures and says why.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from kvtier.core.errors import KVTierError
from kvtier.tiers.file.mounts import SPECIAL_FILESYSTEMS, filesystem_of
from kvtier.tiers.file.rootdir import expand_root_dir


class RootDirError(KVTierError):
    """A --root-dir the file hops cannot be measured in."""


def check_root_dir(path: str, option: str = "--root-dir") -> str:
    """The real path of `path` if the file hops can be measured there; RootDirError (naming
    `option`, the value and what would do) otherwise. Creates nothing that it leaves behind."""
    real = os.path.realpath(os.path.expanduser(path))
    want = "give an existing, writable directory on the filesystem to measure (e.g. the file tier's disk)"
    if not os.path.exists(real):
        raise RootDirError(f"{option} {path}: no such directory; {want}")
    if not os.path.isdir(real):
        raise RootDirError(f"{option} {path}: not a directory; {want}")
    fs = filesystem_of(real)
    if fs["fstype"] in SPECIAL_FILESYSTEMS:
        raise RootDirError(f"{option} {path}: on a {fs['fstype']} filesystem ({fs['mount_point']}), a kernel "
                           f"interface where no file tier can live; {want}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvtier-bench-probe-", dir=real)
    except OSError as exc:
        raise RootDirError(f"{option} {path}: cannot create a file there ({exc.strerror or exc}); {want}") from None
    os.close(fd)
    os.unlink(probe)
    return real


def _config_root(config: Any) -> tuple[str, str] | None:
    """(tier name, root_dir) of the config's first tier with a root_dir, or None."""
    for tier in config.tiers:
        root = dict(tier.options).get("root_dir")
        if root:
            try:
                return tier.name, os.path.abspath(expand_root_dir(root))
            except ValueError:
                return None
    return None


def _nearest_writable(root: str) -> str | None:
    """The nearest existing directory on the way up to `root` (itself included), if writable."""
    parent = root
    while not os.path.isdir(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    return parent if os.access(parent, os.W_OK) else None


def file_hops_place(config: Any, root_dir: str | None) -> dict[str, Any]:
    """Where the file hops run: `parent` (a directory that exists; the bench works in a fresh
    subdirectory of it and removes it), `reason` (one sentence), and `filesystem_of(parent)`.
    `root_dir` (the user's --root-dir) must have passed `check_root_dir`."""
    if root_dir is not None:
        return {"parent": root_dir, "reason": "given by --root-dir", **filesystem_of(root_dir)}
    found = _config_root(config)
    near = _nearest_writable(found[1]) if found else None
    if found and near:
        parent = near
        reason = f"next to the root_dir of tier '{found[0]}', {found[1]} (so on its filesystem)"
    else:
        parent = tempfile.gettempdir()
        reason = (f"the temporary directory: the root_dir of tier '{found[0]}', {found[1]}, has no writable "
                  f"directory on its way" if found else
                  "the temporary directory: the config has no file tier with a root_dir")
    reason += "; --root-dir DIR measures elsewhere"
    return {"parent": parent, "reason": reason, **filesystem_of(parent)}


def describe(place: dict[str, Any]) -> str:
    """One line naming the directory and filesystem measured, and why."""
    fs = (f"{place['fstype']} on {place['device']}, mounted at {place['mount_point']}" if place.get("fstype")
          else "filesystem unknown: /proc/mounts unreadable")
    return f"file hops measured in {place['parent']} ({fs}): {place['reason']}"
