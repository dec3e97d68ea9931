"""`kvtier clear ROOT_DIR [--yes]`: remove a file tier's files, and nothing else.

Only the names the tier writes in its `root_dir` are removed (`rootdir.OWN_FILES`: lock,
manifest.json, slab.0, journal, and the temporaries of an interrupted rewrite); the directory and
anything else in it stay. Refused (exit 2, nothing removed): an empty `ROOT_DIR` (never taken for
the current directory); a path that is a symlink or not a directory; a directory, or a file under
one of the tier's names, that opening a tier there would refuse (`rootdir.check_directory`,
`rootdir.check_owner`: not yours, or writable by group or others -- a shared directory such as
/tmp holds other users' files); a `lock` that is not a regular file of one name (a symlink, a hard
link: `rootdir.check_file`); a directory holding none of the tier's files, or only files that
merely carry its names (`own_files.holds_tier`: neither a kvtier manifest nor a kvtier journal is
there; a `manifest.json` or `journal` of another program is no tier); one of those names being a
directory; a tier open in a live process (its lock is taken first, so no process can open the
tier while its files go: an open meanwhile is told the tier is in use); a `ROOT_DIR` replaced by
another directory meanwhile. The directory is opened once (`O_NOFOLLOW`) and everything after,
the lock included, goes through that descriptor: every name is looked up, opened (the lock) and
unlinked relative to it, so a swap of `ROOT_DIR` or of a path component after the checks can
neither redirect a removal nor touch another directory's `lock`. A name that is a symlink (other
than the lock) is removed itself, never followed. Without `--yes` nothing is removed: what would
be is listed (exit 2). A removal the OS refuses (a read-only directory, an I/O error) stops there:
exit 2, naming what was removed before it and what is left (the lock last, so it is always among
those).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtier.cli.inspect import human_size
from kvtier.core.errors import ConfigError, KVTierError
from kvtier.tiers.file.own_files import holds_tier
from kvtier.tiers.file.rootdir import (
    JOURNAL,
    LOCK,
    MANIFEST,
    OWN_FILES,
    TEMPORARIES,
    check_directory,
    check_file,
    check_owner,
    file_kind,
)
from kvtier.tiers.file.rootlock import RootLock, same_file


def _open_root(root: Path) -> int:
    """A descriptor of the directory `root` itself (never through a final symlink); `KVTierError`
    when it is a symlink or no directory, or opening a tier there would refuse it."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        try:
            st = os.lstat(root)
        except OSError:
            raise KVTierError(f"{root}: {exc.strerror or exc}") from None
        if stat.S_ISLNK(st.st_mode):
            raise KVTierError(f"{root} is a symlink; give the tier's directory itself (links are not "
                              f"followed)") from None
        raise KVTierError(f"{root} is {file_kind(st.st_mode)}, not a directory (give the root_dir of a file "
                          f"tier)") from None
    try:
        with _refused():
            check_directory(os.fstat(fd), str(root), root)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _refused() -> Iterator[None]:
    """A tier's refusal (`ConfigError` on `root_dir`) as `kvtier clear`'s: nothing removed."""
    try:
        yield
    except ConfigError as exc:
        reason = "; ".join(message for _field, message in exc.problems)
        raise KVTierError(f"{reason}; nothing removed (kvtier clear removes only what opening a tier there "
                          f"would accept)") from None


def tier_files(root: Path, dir_fd: int) -> dict[str, os.stat_result]:
    """The tier's own names present in the directory `dir_fd` (`root`: its path, for messages;
    lstat: links not followed); `KVTierError` when it is no tier, one of the names is a directory
    or not yours, or the lock is not one that opening the tier would take."""
    found = {}
    for name in OWN_FILES + TEMPORARIES:
        try:
            found[name] = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
    if not set(found) & set(OWN_FILES):
        raise KVTierError(f"{root} is not a file tier's root_dir: none of its files ({', '.join(OWN_FILES)}) is "
                          f"there; nothing removed")
    dirs = [name for name, st in found.items() if stat.S_ISDIR(st.st_mode)]
    if dirs:
        raise KVTierError(f"{root / dirs[0]} is a directory, not a file kvtier wrote; remove it by hand if you "
                          f"mean to; nothing removed")
    with _refused():
        for name, st in found.items():
            if name == LOCK:  # opened and written to: it must be one the tier itself would take
                check_file(root / name, st, dir_fd)
            else:  # only unlinked: a symlink or a FIFO of yours goes itself
                check_owner(root / name, st)
    if not holds_tier(dir_fd):
        raise KVTierError(f"{root} is not a file tier's root_dir: it has files named like a tier's "
                          f"({', '.join(found)}) but neither a kvtier {MANIFEST} nor a kvtier {JOURNAL}; "
                          f"nothing removed (remove them by hand if they are a tier's leftovers)")
    return found


def _describe(name: str, st: os.stat_result) -> str:
    if stat.S_ISREG(st.st_mode):
        return f"{name} ({human_size(st.st_size)})"
    return f"{name} ({file_kind(st.st_mode)}: removed itself, never followed)"


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _remove(root: Path, dir_fd: int, names: list[str]) -> None:
    """Unlink `names` in order; an OS error (a read-only directory, I/O) becomes a `KVTierError`
    saying what was removed before it and what is left."""
    for i, name in enumerate(names):
        try:
            _unlink(name, dir_fd)
        except OSError as exc:
            done = ", ".join(names[:i]) or "nothing"
            raise KVTierError(f"cannot remove {root / name}: {exc.strerror or exc}; removed before it: {done}; "
                              f"left: {', '.join(names[i:])}") from None


def run_clear(args) -> int:
    if not args.root_dir:  # Path("") is ".": an unset shell variable must not mean the current directory
        raise KVTierError(f"ROOT_DIR is empty ({args.root_dir!r}); give the tier's directory (an unset variable?); "
                          f"nothing removed")
    root = Path(args.root_dir)
    dir_fd = _open_root(root)
    try:
        return _clear(root, dir_fd, args.yes)
    finally:
        os.close(dir_fd)


def _take_lock(root: Path, dir_fd: int) -> RootLock:
    """The tier's lock, taken in the directory checked (whatever `root` names by now); `KVTierError`
    when a live process holds it (the tier is open)."""
    with _refused():
        try:
            return RootLock(root, dir_fd)
        except ConfigError:  # a lock that is no longer one to take
            raise
        except KVTierError as exc:  # held by a live process: the tier is open
            raise KVTierError(f"{root} is a tier in use, nothing removed ({exc}); close it first") from None


def _clear(root: Path, dir_fd: int, yes: bool) -> int:
    found = tier_files(root, dir_fd)
    lock = _take_lock(root, dir_fd)  # (a dry run too: it must not promise what --yes would refuse)
    if not yes:
        if lock.created:  # (a dry run leaves nothing behind)
            _unlink(LOCK, dir_fd)
        lock.release()
        print(f"would remove from {root}: " + ", ".join(_describe(n, st) for n, st in found.items()))
        print("nothing removed: run again with --yes to remove them")
        return 2
    try:
        if not same_file(dir_fd, root):
            if lock.created:
                _unlink(LOCK, dir_fd)
            raise KVTierError(f"{root} was replaced by another directory while it was being cleared; nothing "
                              f"removed")
        found = tier_files(root, dir_fd)  # again, under the lock
        _remove(root, dir_fd, [name for name in found if name != LOCK] + [LOCK])
    finally:
        lock.release()
    total = sum(st.st_size for st in found.values() if stat.S_ISREG(st.st_mode))
    print(f"removed from {root}: {', '.join(found)} ({human_size(total)}); the directory itself is left")
    return 0
