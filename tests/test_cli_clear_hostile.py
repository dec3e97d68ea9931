"""`kvtier clear` among hostile neighbours (issue 36): a parent symlink flipped during the clear, a
hard-linked `lock`, other users' files in a shared directory, and an `open` racing the clear. On
7e6c7c1 the first two emptied (or created) another directory's file, the third removed other
users' files, and the last failed with ENOENT instead of "in use"."""

from __future__ import annotations

import os
import threading
import time

import pytest
from test_cli_clear import build, clear

from kvtier.cli import clear as clear_module
from kvtier.core.errors import KVTierError
from kvtier.tiers.file import rootdir
from kvtier.tiers.file.rootdir import JOURNAL, LOCK, MANIFEST, OWN_FILES, SLAB

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root to create")
PRECIOUS = b"p" * 220


def flip_before_locking(monkeypatch, link, target):
    """Point the symlink `link` at `target` just before `kvtier clear` takes the tier's lock (the
    race, made certain)."""
    taken = clear_module.RootLock

    def flip_then_lock(*args):
        os.unlink(link)
        os.symlink(target, link)
        return taken(*args)

    monkeypatch.setattr(clear_module, "RootLock", flip_then_lock)


@pytest.mark.parametrize("victim_has_lock", [True, False])
def test_a_parent_symlink_flipped_during_clear_touches_nothing_in_the_other_directory(
        tmp_path, capsys, monkeypatch, victim_has_lock):
    """ROOT = link/tier; `link` is flipped to another directory after ROOT was opened: the lock is
    taken in the directory opened, so the other directory's `lock` keeps its bytes (on 7e6c7c1:
    truncated to 0) or is not created (on 7e6c7c1: an empty one was left there)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    build(tmp_path / "a" / "tier").close()
    build(tmp_path / "b" / "tier").close()
    other = tmp_path / "b" / "tier"
    if victim_has_lock:
        (other / LOCK).write_bytes(PRECIOUS)
    else:
        os.unlink(other / LOCK)
    os.symlink(tmp_path / "a", tmp_path / "link")
    flip_before_locking(monkeypatch, tmp_path / "link", tmp_path / "b")
    code, _, err = clear(capsys, str(tmp_path / "link" / "tier"), "--yes")
    assert code == 2 and "was replaced by another directory" in err and "nothing removed" in err
    if victim_has_lock:
        assert (other / LOCK).read_bytes() == PRECIOUS
    else:
        assert not os.path.lexists(other / LOCK)
    assert all((other / name).exists() for name in (MANIFEST, SLAB, JOURNAL))
    assert all((tmp_path / "a" / "tier" / name).exists() for name in OWN_FILES)


def test_a_parent_symlink_flipping_all_the_time_never_touches_the_other_directory(tmp_path, capsys):
    """The issue's race, undirected: a thread flips `link` between two directories while clear runs
    again and again (on 7e6c7c1 the other directory's lock was emptied in 7 of 179 runs)."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    (tmp_path / "b" / "tier").mkdir()
    (tmp_path / "b" / "tier" / LOCK).write_bytes(PRECIOUS)
    (tmp_path / "b" / "tier" / "notes").write_bytes(PRECIOUS)
    os.symlink(tmp_path / "a", tmp_path / "link")
    stop = threading.Event()

    def flip():
        targets = [tmp_path / "b", tmp_path / "a"]
        while not stop.is_set():
            os.symlink(targets[0], tmp_path / "link.new")
            os.replace(tmp_path / "link.new", tmp_path / "link")
            targets.reverse()

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(100):
            if not (tmp_path / "a" / "tier" / MANIFEST).exists():
                build(tmp_path / "a" / "tier").close()
            clear(capsys, str(tmp_path / "link" / "tier"), "--yes")
    finally:
        stop.set()
        flipper.join()
    assert sorted(os.listdir(tmp_path / "b" / "tier")) == [LOCK, "notes"]
    assert (tmp_path / "b" / "tier" / LOCK).read_bytes() == PRECIOUS


@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_a_linked_lock_is_refused_and_the_other_file_keeps_its_bytes(tmp_path, capsys, link):
    """`lock` replaced by a hard link to another file of the same user (on 7e6c7c1: exit 0 and
    the other file emptied, 220 B -> 0), or by a symlink to it (removed, then a lock created)."""
    root = tmp_path / "tier"
    build(root).close()
    victim = tmp_path / "precious"
    victim.write_bytes(PRECIOUS)
    os.unlink(root / LOCK)
    (os.link if link == "hard" else os.symlink)(victim, root / LOCK)
    code, _, err = clear(capsys, str(root), "--yes")
    why = f"{root / LOCK} has 2 names (hard links)" if link == "hard" else f"{root / LOCK} is a symlink (to {victim})"
    assert code == 2 and why in err and "nothing removed" in err
    assert victim.read_bytes() == PRECIOUS and os.path.lexists(root / LOCK)
    assert all((root / name).exists() for name in OWN_FILES if name != LOCK)


def _tier_of_nobody(root):
    build(root).close()
    os.unlink(root / LOCK)
    for name in (JOURNAL, MANIFEST, SLAB):
        os.chown(root / name, NOBODY, NOBODY)


@as_root
def test_other_users_files_in_a_shared_directory_are_refused(tmp_path, capsys):
    """A root-owned mode-1777 directory (like /tmp) holding uid 65534's tier files: opening a tier
    there is refused, and so is clearing it (on 7e6c7c1 they were all removed)."""
    shared = tmp_path / "shared"
    _tier_of_nobody(shared)
    os.chmod(shared, 0o1777)
    code, _, err = clear(capsys, str(shared), "--yes")
    assert code == 2 and f"{shared} is writable by group or others (mode 1777" in err, err
    assert "if it is shared by its users (sticky, like /tmp), leave it as it is" in err
    assert "nothing removed" in err
    assert sorted(os.listdir(shared)) == sorted([JOURNAL, MANIFEST, SLAB])


@as_root
def test_another_users_files_in_your_own_directory_are_refused(tmp_path, capsys):
    root = tmp_path / "tier"
    _tier_of_nobody(root)
    code, _, err = clear(capsys, str(root), "--yes")
    assert code == 2 and f"is owned by uid {NOBODY} (nobody)" in err and "not by you" in err, err
    assert sorted(os.listdir(root)) == sorted([JOURNAL, MANIFEST, SLAB])


def test_an_open_whose_lock_is_removed_under_it_creates_it_again(tmp_path, monkeypatch):
    """The lock is unlinked (by `kvtier clear`) between the open's failed O_EXCL create and its
    open of the existing file: the open takes a new lock (on 7e6c7c1: ConfigError, ENOENT)."""
    root = tmp_path / "tier"
    build(root).close()
    real = rootdir.open_existing
    removed = []

    def removed_first(path, flags, dir_fd=None):
        if os.path.basename(path) == LOCK and not removed:
            os.unlink(path if dir_fd is None else LOCK, dir_fd=dir_fd)
            removed.append(path)
        return real(path, flags) if dir_fd is None else real(path, flags, dir_fd)

    monkeypatch.setattr(rootdir, "open_existing", removed_first)
    build(root).close()
    assert removed


def test_opens_racing_clears_are_told_in_use_never_enoent(tmp_path, capsys):
    """Opens and clears of one tier, concurrently: each open succeeds or says the tier is in use."""
    root = tmp_path / "tier"
    build(root).close()
    errors: list[str] = []
    deadline = time.monotonic() + 2.0

    def opener():
        while time.monotonic() < deadline:
            try:
                build(root).close()
            except KVTierError as exc:
                errors.append(str(exc))

    thread = threading.Thread(target=opener)
    thread.start()
    try:
        while time.monotonic() < deadline:
            clear(capsys, str(root), "--yes")
    finally:
        thread.join()
    assert all("is in use by" in e for e in errors), [e for e in errors if "is in use by" not in e][:3]
