"""`RootLock`: the exclusive flock on `root_dir/lock` that makes a process the file tier's only
user, and `same_file`, whether a path still names an open file (the lock's and `kvtier clear`'s
guard against a directory swapped underneath)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvtier.core.errors import KVTierError
from kvtier.tiers.file.rootdir import LOCK, open_or_create, owner_name


class RootLock:
    """The exclusive flock on `root_dir/lock` that makes a process the tier's only user; the
    file holds the owner's pid (for the error others get, and for `kvtier inspect`)."""

    def __init__(self, root: Path, dir_fd: int | None = None):
        """Take the lock (KVTierError naming the holder's pid when another process has it). With
        `dir_fd` (a descriptor of the directory `root`), the lock file is opened, checked and
        created in that directory, whatever `root` names by then. When recording the pid fails
        the lock is released and its descriptor closed before the error propagates."""
        self.path = root / LOCK
        while True:
            fd, created = open_or_create(self.path, os.O_RDWR, dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                finally:
                    os.close(fd)
                raise KVTierError(f"file tier root_dir {root} is in use by {_process(holder)}; "
                                  f"give each process its own root_dir") from None
            if same_file(fd, self.path if dir_fd is None else Path(LOCK), dir_fd):
                break
            os.close(fd)  # a failed build removed the file after we opened it: lock the current one
        self.created = created  # the lock file did not exist before
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            fcntl.flock(fd, fcntl.LOCK_UN)  # no object holds it yet: nobody else could release it
            os.close(fd)
            raise
        self._fd = fd

    def release(self, clean: bool = True) -> None:
        """Unlock and close. Idempotent. After a `clean` close the pid is erased first, so that
        `kvtier inspect` tells a tier closed cleanly from one whose process died holding it. The
        lock is released and its descriptor closed even when erasing the pid fails (that error
        is raised afterwards)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                if clean:
                    os.ftruncate(fd, 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


def same_file(fd: int, path: Path, dir_fd: int | None = None) -> bool:
    """Whether `path` (relative to the directory `dir_fd`, where given) still names the file open
    as `fd`."""
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _process(pid_text: str) -> str:
    """"another process of yours (pid 123)", "a process of uid 7 (bob) (pid 123)", or what the
    lock file held."""
    if not pid_text.isdigit():
        return f"another process (the lock file holds {pid_text[:32]!r})"
    try:
        uid = os.stat(f"/proc/{pid_text}").st_uid
    except OSError:
        return f"another process (pid {pid_text})"
    return (f"another process of yours (pid {pid_text})" if uid == os.getuid()
            else f"a process of {owner_name(uid)} (pid {pid_text})")
