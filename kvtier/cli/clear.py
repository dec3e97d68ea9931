"""`kvtier clear ROOT_DIR [--yes]`: remove a file tier's files, and nothing else.

Only the names the tier writes in its `root_dir` are removed (`rootdir.OWN_FILES`: lock,
manifest.json, slab.0, journal, and the temporaries of an interrupted rewrite); the directory and
anything else in it stay. Refused (exit 2, nothing removed): a path that is a symlink, not a
directory or not yours; a directory holding none of the tier's files; one of those names being a
directory; a tier open in a live process (its lock is taken first, so no process can open the tier
while its files go). A name that is a symlink is removed itself, never followed. Without `--yes`
nothing is removed: what would be is listed (exit 2).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtier.cli.inspect import human_size
from kvtier.errors import KVTierError
from kvtier.tiers.rootdir import LOCK, OWN_FILES, TEMPORARIES, RootLock, file_kind, remove_file


def _check_root(root: Path) -> None:
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise KVTierError(f"{root}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise KVTierError(f"{root} is a symlink; give the tier's directory itself (links are not followed)")
    if not stat.S_ISDIR(st.st_mode):
        raise KVTierError(f"{root} is {file_kind(st.st_mode)}, not a directory (give the root_dir of a file tier)")
    if st.st_uid != os.geteuid():
        raise KVTierError(f"{root} is not yours (owner uid {st.st_uid}); only its owner may clear it")


def tier_files(root: Path) -> dict[str, os.stat_result]:
    """The tier's own names present in `root` (lstat: links not followed); `KVTierError` when
    none of its files is there, or when one of the names is a directory."""
    found = {}
    for name in OWN_FILES + TEMPORARIES:
        try:
            found[name] = os.lstat(root / name)
        except FileNotFoundError:
            continue
    if not set(found) & set(OWN_FILES):
        raise KVTierError(f"{root} is not a file tier's root_dir: none of its files ({', '.join(OWN_FILES)}) is "
                          f"there; nothing removed")
    dirs = [name for name, st in found.items() if stat.S_ISDIR(st.st_mode)]
    if dirs:
        raise KVTierError(f"{root / dirs[0]} is a directory, not a file kvtier wrote; remove it by hand if you "
                          f"mean to; nothing removed")
    return found


def _describe(name: str, st: os.stat_result) -> str:
    if stat.S_ISREG(st.st_mode):
        return f"{name} ({human_size(st.st_size)})"
    return f"{name} ({file_kind(st.st_mode)}: removed itself, never followed)"


def run_clear(args) -> int:
    root = Path(args.root_dir)
    _check_root(root)
    found = tier_files(root)
    if not args.yes:
        print(f"would remove from {root}: " + ", ".join(_describe(n, st) for n, st in found.items()))
        print("nothing removed: run again with --yes to remove them")
        return 2
    lock_st = found.get(LOCK)
    if lock_st is not None and not stat.S_ISREG(lock_st.st_mode):
        remove_file(root / LOCK)  # no kvtier process locks through anything but a regular file
    try:
        lock = RootLock(root)
    except KVTierError as exc:  # held by a live process: the tier is open
        raise KVTierError(f"{root} is a tier in use, nothing removed ({exc}); close it first") from None
    try:
        found = tier_files(root)  # again, under the lock
        for name in found:
            if name != LOCK:
                remove_file(root / name)
        remove_file(root / LOCK)
    finally:
        lock.release()
    total = sum(st.st_size for st in found.values() if stat.S_ISREG(st.st_mode))
    print(f"removed from {root}: {', '.join(found)} ({human_size(total)}); the directory itself is left")
    return 0
