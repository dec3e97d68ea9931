"""`RootLock`: the root's exclusive lock is not left held when taking it half fails."""
import os

import pytest

from kvtier.core.errors import KVTierError
from kvtier.tiers.file import rootdir, rootlock
from kvtier.tiers.file.rootlock import RootLock


def test_second_lock_on_held_root_is_refused(tmp_path):
    lock = RootLock(tmp_path)
    try:
        with pytest.raises(KVTierError, match="in use by"):
            RootLock(tmp_path)
    finally:
        lock.release()


def test_failed_pid_write_releases_the_lock(tmp_path, monkeypatch):
    opened: list[int] = []
    real_open = rootlock.open_or_create

    def recording_open(path, flags, dir_fd=None):
        fd, created = real_open(path, flags, dir_fd)
        opened.append(fd)
        return fd, created

    def failing_pwrite(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rootlock, "open_or_create", recording_open)
    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    with pytest.raises(OSError, match="No space left"):
        RootLock(tmp_path)
    monkeypatch.undo()
    with pytest.raises(OSError):
        os.fstat(opened[-1])  # the descriptor was closed
    lock = RootLock(tmp_path)  # and the flock released: the root opens again
    try:
        assert (tmp_path / rootdir.LOCK).read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()
