"""The files of the CPU tier's regions in /dev/shm, apart from the mapping itself: the region
header, the claim that holds a region's name for its owner's whole life, exclusive publication
of both, their removal at close, exit and SIGTERM, and the sweep of those whose owner died.
`kvtier.tiers.cpu.backend` (the backend) is their only user."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import signal
import stat
import struct
import threading
import time
from typing import Any, NamedTuple

from kvtier.core.errors import KVTierError
from kvtier.tiers.owners import pid_alive

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"

# Region header (first page): magic, creator pid, token, num_blocks, slot_stride, block_bytes.
_MAGIC = b"kvtier-region\x00v1"
_HEADER = struct.Struct("<16sQ16sQQQ")
HEADER_BYTES = mmap.PAGESIZE  # slot 0 starts on the second page: slots stay page-aligned
_TMP_PREFIX = "kvtier-creating-"
CLAIM_SUFFIX = ".kvtier-claim"  # the claim of region <name> is <name>.kvtier-claim
_CLAIM_MAGIC = b"kvtier-claim v1 pid "  # a claim's content: this, the owner's pid, "\n"


class RegionInUseError(KVTierError, FileExistsError):
    """The region's name is taken: by a live owner, or by a file that is not a kvtier region."""


class RegionHeader(NamedTuple):
    pid: int
    token: str  # hex
    num_blocks: int
    slot_stride: int
    block_bytes: int


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------------ names this process must remove
# path -> (st_dev, st_ino) of each region name and claim this process published and has not removed yet.
# A forked child inherits the table, not the ownership: it starts with an empty one.
_PUBLISHED: dict[str, tuple[int, int]] = {}
os.register_at_fork(after_in_child=_PUBLISHED.clear)
_TERM_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_previous_handlers: dict[int, Any] = {}


def _unlink_if_same(path: str, ident: tuple[int, int]) -> None:
    """Remove `path` if it still names the file `ident` (st_dev, st_ino): once a name was given
    up, another process may have published its own region under it."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # best effort: a region whose owner is gone is removed by the next sweep
        log.warning("could not remove shared-memory region %s: %s", path, exc)
    finally:
        if _PUBLISHED.get(path) == ident:
            _PUBLISHED.pop(path, None)


def _remove_names_of_creator(creator_pid: int, *names: tuple[str, tuple[int, int]]) -> None:
    """`close` and exit of a region's creator: remove its names (path, ident) in order, unless this
    is a forked copy."""
    if os.getpid() == creator_pid:
        for path, ident in names:
            _unlink_if_same(path, ident)


def _on_terminate(signum: int, frame: Any) -> None:
    """SIGTERM/SIGHUP: remove this process's region names and claims, then do what the signal did before."""
    for path, ident in list(_PUBLISHED.items()):
        _unlink_if_same(path, ident)
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # the default action (terminate), with the same status
    os.kill(os.getpid(), signum)


def _install_terminate_handlers() -> None:
    """Python's default SIGTERM ends the process without finalizers or atexit: without this, a
    plain `kill` would leave the region (the full CPU tier) in /dev/shm. Signals set to be
    ignored, or handled outside Python, are left alone; only the main thread can set handlers."""
    if _previous_handlers or threading.current_thread() is not threading.main_thread():
        return
    for signum in _TERM_SIGNALS:
        previous = signal.getsignal(signum)
        if previous is None or previous == signal.SIG_IGN or previous is _on_terminate:
            continue
        _previous_handlers[signum] = previous
        signal.signal(signum, _on_terminate)


# ------------------------------------------------------------------ header and owner checks
def _read_header(fd: int) -> RegionHeader | None:
    """The header of the region open as `fd`, or None if it is not a kvtier region."""
    try:
        raw = os.pread(fd, _HEADER.size, 0)
    except OSError:
        return None
    if len(raw) != _HEADER.size:
        return None
    magic, pid, token, num_blocks, slot_stride, block_bytes = _HEADER.unpack(raw)
    if magic != _MAGIC:
        return None
    return RegionHeader(pid, token.hex(), num_blocks, slot_stride, block_bytes)


def _read_claim(fd: int) -> int | None:
    """The owner pid written in the claim open as `fd`, or None if it is not a kvtier claim."""
    try:
        raw = os.pread(fd, 64, 0)
    except OSError:
        return None
    pid = raw[len(_CLAIM_MAGIC):-1]
    if not raw.startswith(_CLAIM_MAGIC) or not raw.endswith(b"\n") or not pid.isdigit():
        return None
    return int(pid)


def _lock_if_owner_dead(fd: int) -> bool:
    """Take the exclusive lock of the region open as `fd`: True (locked) iff no owner holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _open_no_follow(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)


def remove_stale_regions(shm_dir: str | None = None, min_age_s: float = 10.0) -> list[str]:
    """Remove the regions and claims whose creating process is gone, whatever their names, and
    return the names of the files removed.

    A region is a file of this user that carries a kvtier region header, or (regions of earlier
    kvtier versions, and half-built ones) whose name starts with `kvtier-`; a claim is a file of
    this user named `<name>.kvtier-claim` whose content is a kvtier claim. The owner is gone when
    the flock can be taken exclusively (a creator holds one for its whole life); a headerless
    `kvtier-<pid>-...` region also needs that pid gone (versions that took no lock).
    A SIGKILLed owner cannot remove its files itself: without this sweep each kill would leave
    the full size of its CPU tier in /dev/shm until reboot. Files of other users, non-regular
    files, files still locked and files younger than `min_age_s` (a creator may be between
    creating and locking one) are left alone.
    """
    shm_dir = shm_dir or SHM_DIR
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if _remove_if_stale(os.path.join(shm_dir, name), min_age_s):
            removed.append(name)
    if removed:
        log.warning("removed %d shared-memory region(s) or claim(s) left in %s by processes that died: %s",
                    len(removed), shm_dir, ", ".join(removed[:5]))
    return removed


def _remove_if_stale(path: str, min_age_s: float) -> bool:
    name = os.path.basename(path)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return False
    try:
        fd = _open_no_follow(path)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        if name.endswith(CLAIM_SUFFIX):
            if _read_claim(fd) is None:
                return False  # not a kvtier claim
        elif _read_header(fd) is None:
            if not name.startswith("kvtier-"):
                return False  # not a kvtier region
            pid = name.split("-")[1]
            if pid.isdigit() and pid_alive(int(pid)):
                return False
        if time.time() - st.st_ctime < min_age_s or not _lock_if_owner_dead(fd):
            return False
        _unlink_if_same(path, (st.st_dev, st.st_ino))
        return True
    finally:
        os.close(fd)


def region_in_use(name: str, shm_dir: str = SHM_DIR) -> str | None:
    """Why a region named `name` could not be created now (its claim or region held by a live
    process, or a file there that is not a kvtier one of this user), None when it could; changes
    nothing (a lock found free is taken and released at once)."""
    try:
        for held in (_takeable_claim(os.path.join(shm_dir, name + CLAIM_SUFFIX)),
                     _takeable_region(os.path.join(shm_dir, name))):
            if held is not None:
                os.close(held[0])  # (releases the lock)
    except RegionInUseError as exc:
        return str(exc)
    return None


def _in_use(name: str, owner: str) -> RegionInUseError:
    return RegionInUseError(f"region {name} is in use by {owner}: two kvtier instances cannot share one CPU tier; "
                            f"give each its own shm_name (under vLLM the default name comes from the "
                            f"engine_id: give each engine its own)")


def _free_region_name(path: str) -> None:
    """Make `path` free for a new region, or raise `RegionInUseError` (`_takeable_region`)."""
    held = _takeable_region(path)
    if held is None:
        return
    fd, st, pid = held
    try:
        log.warning("removing shared-memory region %s left by pid %s, which died", path, pid)
        _unlink_if_same(path, (st.st_dev, st.st_ino))
    finally:
        os.close(fd)


def _takeable_region(path: str) -> tuple[int, os.stat_result, int | str] | None:
    """The region file at `path` opened and locked, its owner having died: (descriptor, stat, the
    owner's pid or "?"), to be closed by the caller; None when nothing is there. `RegionInUseError`
    when its owner is alive or the file is not a kvtier region of this user (never taken over)."""
    name = os.path.basename(path)
    fd = _open_existing(path, "a region")
    if fd is None:
        return None
    try:
        st, header = os.fstat(fd), _read_header(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                or (header is None and not name.startswith("kvtier-"))):
            raise RegionInUseError(f"{path} exists and is not a kvtier region of this user; remove it or "
                                   f"choose another shm_name")
        if not _lock_if_owner_dead(fd):
            raise _in_use(name, f"pid {header.pid}" if header else "another process")
    except BaseException:
        os.close(fd)
        raise
    return fd, st, header.pid if header else "?"


def _open_existing(path: str, what: str) -> int | None:
    """`path` opened without following a link, or None when nothing is there; `RegionInUseError`
    (saying it cannot be opened as `what`) when something is there that cannot be opened."""
    try:
        return _open_no_follow(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RegionInUseError(f"{path} exists and cannot be opened as {what} ({exc.strerror}); "
                               f"remove it or choose another shm_name") from None


def _free_claim(path: str) -> None:
    """Make the claim `path` free, or raise `RegionInUseError` (`_takeable_claim`)."""
    held = _takeable_claim(path)
    if held is None:
        return
    fd, st, pid = held
    try:
        log.warning("taking over the name of region %s from pid %s, which died",
                    os.path.basename(path)[:-len(CLAIM_SUFFIX)], pid)
        _unlink_if_same(path, (st.st_dev, st.st_ino))
    finally:
        os.close(fd)


def _takeable_claim(path: str) -> tuple[int, os.stat_result, int | str] | None:
    """The claim file at `path` opened and locked, its owner having died: (descriptor, stat, the
    owner's pid), to be closed by the caller; None when nothing is there. `RegionInUseError` when
    its owner is alive (its lock is held) or the file is not a kvtier claim of this user."""
    region = os.path.basename(path)[:-len(CLAIM_SUFFIX)]
    fd = _open_existing(path, f"the claim of region {region}")
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        pid = _read_claim(fd) if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() else None
        if pid is None:
            raise RegionInUseError(f"{path} exists and is not a kvtier claim of this user; remove it or "
                                   f"choose another shm_name")
        if not _lock_if_owner_dead(fd):
            raise _in_use(region, f"pid {pid}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st, pid


def _link_exclusively(tmp: str, path: str, free: Any) -> None:
    """Publish the file `tmp` (already locked and filled) as `path` with link(2), which never
    replaces a file: when `path` exists, `free(path)` removes it (left by a dead owner) or raises."""
    for _ in range(3):
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            free(path)
    raise RegionInUseError(f"{path}: the name was taken again each time it was freed; choose another shm_name")


def _new_locked_file(directory: str, lock: int, content: bytes) -> tuple[int, str]:
    """A new file of this user (0600) under a temporary name in `directory`, flocked with `lock`
    and holding `content`: (descriptor, temporary path). The caller publishes and removes the name."""
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, lock)
        os.pwrite(fd, content, 0)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    return fd, tmp


def _take_claim(region_path: str) -> tuple[int, tuple[int, int]]:
    """Hold the name `region_path` for this process: publish its claim, exclusively locked from
    its first instant (the lock is the descriptor returned, with the claim's (st_dev, st_ino)).
    Raises `RegionInUseError` when a live owner holds the claim."""
    path = region_path + CLAIM_SUFFIX
    fd, tmp = _new_locked_file(os.path.dirname(path), fcntl.LOCK_EX, _CLAIM_MAGIC + b"%d\n" % os.getpid())
    try:
        _link_exclusively(tmp, path, _free_claim)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    finally:
        _unlink_quietly(tmp)
    _PUBLISHED[path] = (st.st_dev, st.st_ino)
    return fd, (st.st_dev, st.st_ino)
