"""The file tier's root_dir is not trusted: nothing in it is followed through a symlink, files or
directories of other users (or writable by them) are refused, and a failed build leaves nothing.

Each refusal is a ConfigError on `tiers[1].root_dir` naming the path, its owner/mode and what to do.
The other-user checks need root (to chown to, or run a process as, `nobody`); they are skipped
otherwise. The disk-full cases mount a small tmpfs (skipped where mounting is not allowed).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from reliability_helpers import BLOCK, build, config_text, fill_file_tier, keys, payload, read, tmpfs

from kvtier import ConfigError, load_config, load_config_text
from kvtier.config import default_config_path
from kvtier.tiers.file import fileio
from kvtier.tiers.file.backend import FileBackend, Journal

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root to create")
FIELD = r"tiers\[1\]\.root_dir: "


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def snapshot(path: Path) -> tuple[bytes, int]:
    """A file's bytes and modification time: what must not change."""
    return path.read_bytes(), path.stat().st_mtime_ns


def used_tier(root: Path) -> list:
    """A tier in `root` holding a few blocks, closed; returns their keys."""
    h = build(root)
    try:
        return fill_file_tier(h, 3)
    finally:
        h.close()


@pytest.fixture
def open_dir():
    """A world-traversable (0755) scratch directory, so that `nobody` can work in it."""
    d = tempfile.mkdtemp(prefix="kvtier-rootdir-")
    os.chmod(d, 0o755)
    yield Path(d)
    subprocess.run(["rm", "-rf", d])


# ---------------------------------------------------------------------------- symlinks
@pytest.mark.parametrize("name", ["slab.0", "lock", "journal", "manifest.json"])
def test_a_symlinked_tier_file_is_refused_and_its_target_untouched(tmp_path, name):
    """The link points at a copy of the real file (so following it would look valid): the build is
    refused and the target keeps its bytes; on the old code the slab, lock and journal targets were
    truncated or written through."""
    root = tmp_path / "kv"
    ks = used_tier(root)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n" if name == "lock" else (root / name).read_bytes())
    before = snapshot(victim)
    (root / name).unlink()
    (root / name).symlink_to(victim)
    try:
        h = build(root)
    except ConfigError as exc:
        error = exc
    else:  # the old code: use the tier as anyone would, then show what happened to the target
        try:
            fill_file_tier(h, 2, start=100)
        finally:
            h.close()
        error = None
    assert snapshot(victim) == before, f"{name}: the symlink's target was written"
    assert error is not None, f"a symlink at {name} was accepted"
    message = str(error)
    assert message.startswith("tiers[1].root_dir: "), message
    assert f"{root / name} is a symlink (to {victim})" in message and "Remove it" in message
    # nothing else was touched either: with the file back in place every block is there
    os.replace(victim, root / name)
    h = build(root)
    try:
        assert all(read(h, k) == payload(k) for k in ks)
    finally:
        h.close()


@pytest.mark.parametrize("name", ["slab.0", "lock"])
def test_a_hard_linked_tier_file_is_refused_and_its_other_name_untouched(tmp_path, name):
    """A tier file with a second name (a hard link to a file outside the tier) would be written
    through: on 7e6c7c1 the open emptied a hard-linked `lock` and re-extended a hard-linked slab."""
    root = tmp_path / "kv"
    used_tier(root)
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 220)
    (root / name).unlink()
    os.link(victim, root / name)
    before = snapshot(victim)
    try:
        build(root).close()
    except ConfigError as exc:
        error = str(exc)
    else:
        error = ""
    assert snapshot(victim) == before, f"{name}: the file of its other name was written"
    assert f"{root / name} has 2 names (hard links)" in error and "remove it" in error, error


@pytest.mark.parametrize("name", ["journal.tmp", "manifest.json.tmp"])
@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_temporary_file_is_replaced_not_followed(tmp_path, name, dangling):
    """A leftover temporary file is unlinked and created afresh (O_EXCL): the link's target is
    neither written nor (when missing) created."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    if not dangling:
        victim.write_bytes(b"precious\n")
        before = snapshot(victim)
    (root / name).symlink_to(victim)
    h = build(root)
    try:
        ks = fill_file_tier(h, 4)
        assert all(read(h, k) == payload(k) for k in ks)
    finally:
        h.close()
    if dangling:
        assert not victim.exists(), "a file was created through a dangling symlink"
    else:
        assert snapshot(victim) == before
    assert not os.path.lexists(root / name)
    for tier_file in ("slab.0", "journal", "manifest.json", "lock"):
        assert not (root / tier_file).is_symlink() and mode(root / tier_file) == 0o600


def test_the_block_ios_and_the_journal_never_open_through_a_symlink(tmp_path):
    """Every open of the tier's files is O_NOFOLLOW, not only the checks at build."""
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(8192))
    before = snapshot(victim)
    link = tmp_path / "link"
    link.symlink_to(victim)
    opens = [lambda: fileio.PosixIO(str(link), direct=False), lambda: fileio.probe_direct(str(link)),
             lambda: Journal(link, bytes(16), 0, 8192)]
    if fileio.kvikio_importable():
        opens.append(lambda: fileio.KvikioIO(str(link), 1))
    for open_it in opens:
        with pytest.raises(ConfigError, match=rf"{link} is a symlink"):
            open_it()
    assert snapshot(victim) == before


def test_root_dir_through_a_symlink_of_another_user_is_refused(open_dir, tmp_path):
    """A link planted in a shared sticky directory (like /tmp) by another user is not followed,
    even to a directory of ours; a link of our own (e.g. ~/.cache -> /data/cache) is."""
    shared = open_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    ours = shared / "ours"
    ours.symlink_to(mine)
    h = build(ours / "kv")
    try:
        assert h.backends["disk"].root == mine / "kv"
    finally:
        h.close()
    if os.geteuid() != 0:
        pytest.skip("a symlink of another user needs root to create")
    planted = shared / "kvtier"
    planted.symlink_to(mine)
    os.lchown(planted, NOBODY, NOBODY)
    before = sorted(os.listdir(mine))
    with pytest.raises(ConfigError, match=FIELD + rf"{planted} .*is a symlink owned by uid {NOBODY}"):
        build(planted)
    with pytest.raises(ConfigError, match=FIELD + rf"{planted} .*is a symlink owned by uid {NOBODY}"):
        build(planted / "kv")
    assert sorted(os.listdir(mine)) == before


def test_world_writable_parent_without_sticky_bit_is_refused(open_dir):
    parent = open_dir / "anyone"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(ConfigError, match=FIELD + rf"{parent}, a parent of root_dir .* without the sticky bit"):
        build(parent / "kv")
    assert os.listdir(parent) == []


# ---------------------------------------------------------------------------- owners and modes
@pytest.mark.parametrize("dir_mode", [0o777, 0o770, 0o1777, 0o720])
def test_group_or_world_writable_root_dir_is_refused(tmp_path, dir_mode):
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, dir_mode)
    with pytest.raises(ConfigError, match=FIELD + rf"{root} is writable by group or others "
                                               rf"\(mode {dir_mode:04o}.*chmod 700"):
        build(root)
    assert os.listdir(root) == [] and mode(root) == dir_mode


@as_root
def test_files_planted_by_another_user_are_refused(open_dir):
    """The issue's scenario with a real second user: `nobody` pre-creates world-writable tier files
    in a world-writable root_dir. Refused; and still refused once the directory is made private,
    because the files are not ours. The planted files are left as they were (empty)."""
    root = open_dir / "kv"
    root.mkdir()
    os.chmod(root, 0o777)
    proc = subprocess.run(["/bin/sh", "-c", "umask 0; : > slab.0; : > lock; : > journal"], cwd=root,
                          user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert os.stat(root / "slab.0").st_uid == NOBODY
    with pytest.raises(ConfigError, match=FIELD + rf"{root} is writable by group or others \(mode 0777"):
        build(root)
    os.chmod(root, 0o700)
    with pytest.raises(ConfigError, match=FIELD + rf"{root}/\S+ is owned by uid {NOBODY} \(nobody\) "
                                               rf"\(mode 0666\), not by you.*remove it"):
        build(root)
    for name in ("slab.0", "lock", "journal"):
        st = os.stat(root / name)
        assert (st.st_uid, st.st_size, stat.S_IMODE(st.st_mode)) == (NOBODY, 0, 0o666)
    assert sorted(os.listdir(root)) == ["journal", "lock", "slab.0"]


@as_root
def test_root_dir_of_another_user_is_refused(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=FIELD + rf"{root} is owned by uid {NOBODY} \(nobody\) \(mode 0700\)"):
        build(root)
    assert os.listdir(root) == []


@pytest.mark.parametrize("file_mode", [0o666, 0o620])
def test_own_file_writable_by_others_is_refused(tmp_path, file_mode):
    root = tmp_path / "kv"
    used_tier(root)
    os.chmod(root / "slab.0", file_mode)
    with pytest.raises(ConfigError, match=FIELD + rf"{root}/slab.0 is writable by group or others "
                                               rf"\(mode {file_mode:04o}\)"):
        build(root)


def test_own_file_readable_by_others_is_made_private(tmp_path):
    root = tmp_path / "kv"
    ks = used_tier(root)
    for name in ("slab.0", "journal", "manifest.json", "lock"):
        os.chmod(root / name, 0o644)
    h = build(root)
    try:
        assert all(read(h, k) == payload(k) for k in ks)
    finally:
        h.close()
    for name in ("slab.0", "journal", "manifest.json", "lock"):
        assert mode(root / name) == 0o600, name


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_tier_name_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    if kind == "fifo":
        os.mkfifo(root / "slab.0", 0o600)
    else:
        (root / "slab.0").mkdir(mode=0o700)
    word = "a FIFO" if kind == "fifo" else "a directory"
    with pytest.raises(ConfigError, match=FIELD + rf"{root}/slab.0 is {word}, not a regular file"):
        build(root)


# ---------------------------------------------------------------------------- build-time OS errors
def test_root_dir_that_is_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"data")
    for root in (afile, afile / "kv"):
        with pytest.raises(ConfigError, match=FIELD + rf"{afile} \(on the path of {root}\) is a regular file, "
                                                   r"not a directory"):
            build(root)
    assert afile.read_bytes() == b"data" and sorted(os.listdir(tmp_path)) == ["afile"]


def test_too_long_root_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    long_name = tmp_path / ("n" * 300)
    with pytest.raises(ConfigError, match=FIELD + r".*a path component of 300 bytes; at most 255"):
        load_config_text(config_text(long_name))
    deep = tmp_path.joinpath(*["d" * 200] * 25)  # every name fits, the whole path does not
    with pytest.raises(ConfigError, match=FIELD + r".*too long for the files in it"):
        load_config_text(config_text(deep))
    with pytest.raises(ConfigError, match=r"^root_dir: .*a path component of 300 bytes"):
        FileBackend("disk", 4, BLOCK, root_dir=str(long_name), io="posix", fingerprint="test-model")
    assert os.listdir(tmp_path) == []


def test_journal_that_does_not_fit_is_refused_and_nothing_is_left(tmp_path):
    """On a 1300 KiB tmpfs the slab of 32 blocks (640 KiB) fits but slab + journal (1 MiB) does not:
    refused before anything is written (the old code left the slab, lock and journal.tmp behind
    with a raw ENOSPC)."""
    with tmpfs("1300k") as mnt:
        root = Path(mnt) / "new" / "kv"
        with pytest.raises(ConfigError, match=FIELD + rf"not enough free space in {root} for file tier 'disk': "
                                                   r"its slab of 32 blocks \(640KiB\) and its journal \(1MiB\)"):
            build(root, file_blocks=32)
        assert os.listdir(mnt) == [], "a failed build left files or directories behind"
        h = build(root, file_blocks=8)  # what fits is built
        h.close()


def test_disk_full_during_the_build_leaves_nothing(tmp_path, monkeypatch):
    """The filesystem claims room but the journal hits ENOSPC for real: the same clear error (the
    OS error as its cause), and the files this build created are removed. A root_dir that existed
    before stays (empty)."""
    real_statvfs = os.statvfs

    def roomy(path):
        st = real_statvfs(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, 1 << 30, 1 << 30, 1 << 30, *tuple(st)[5:]))

    with tmpfs("1m") as mnt:
        root = Path(mnt) / "kv"
        root.mkdir(mode=0o700)
        monkeypatch.setattr(os, "statvfs", roomy)
        no_space = FIELD + rf"not enough free space in {root} .*No space left on device"
        with pytest.raises(ConfigError, match=no_space) as info:
            build(root, file_blocks=32)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert os.listdir(mnt) == ["kv"] and os.listdir(root) == []


def test_a_refused_rebuild_leaves_the_previous_contents(tmp_path):
    """Reopening with a capacity the filesystem cannot hold is refused before the old tier is
    touched: reopened as it was, every block is still there."""
    with tmpfs("2m") as mnt:
        root = Path(mnt) / "kv"
        ks = used_tier(root)  # 32 blocks: 640 KiB + a 1 MiB journal
        before = {name: snapshot(root / name) for name in ("slab.0", "journal", "manifest.json")}
        with pytest.raises(ConfigError, match=FIELD + "not enough free space"):
            build(root, file_blocks=64)
        assert {name: snapshot(root / name) for name in before} == before
        h = build(root)
        try:
            assert all(read(h, k) == payload(k) for k in ks)
        finally:
            h.close()


@pytest.mark.parametrize("reset", [False, True], ids=["refuse", "reset"])
def test_another_programs_files_under_the_tiers_names_are_never_overwritten(tmp_path, reset):
    """root_dir given by mistake: a directory of another program's `journal`, `slab.0` and
    `manifest.json`. Before, the tier took them for its own and rebuilt over them (erased)."""
    root = tmp_path / "notes"
    root.mkdir(mode=0o700)
    mine = {"journal": b"2026-11-27: dear diary\n", "slab.0": b"a slab of text\n", "manifest.json": b'{"name": "app"}'}
    for name, data in mine.items():
        (root / name).write_bytes(data)
    with pytest.raises(ConfigError, match=FIELD + r".*holds manifest.json, journal, slab.0 that file tier 'disk' did "
                       r"not write \(no tier's manifest or journal is there\); kvtier will not overwrite them"):
        build(root, reset=reset)
    assert {name: (root / name).read_bytes() for name in mine} == mine


def test_the_leftovers_of_an_interrupted_first_build_are_rebuilt(tmp_path):
    """A first build stopped after allocating its (zero-filled) slab, before its journal and
    manifest: the tier's own leftovers, so the tier starts empty over them."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    (root / "slab.0").write_bytes(bytes(4096))
    (root / "journal").write_bytes(b"")
    h = build(root)
    try:
        (k,) = fill_file_tier(h, 1)
        assert read(h, k) == payload(k)
    finally:
        h.close()


# ---------------------------------------------------------------------------- ~ and $VARS
def test_home_and_variables_are_expanded(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(mode=0o700)
    cwd.mkdir(mode=0o700)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("KVT_SUB", "sub")
    for written, where in (("$HOME/kv", home / "kv"), ("${HOME}/${KVT_SUB}/kv", home / "sub" / "kv"),
                           ("~/tilde", home / "tilde")):
        cfg = load_config_text(config_text(written))
        assert cfg.tiers[1].options["root_dir"] == str(where)
        h = build(written)
        try:
            fill_file_tier(h, 1)
            assert h.backends["disk"].root == where and (where / "slab.0").is_file()
        finally:
            h.close()
    assert os.listdir(cwd) == [], "a '$' was taken literally"


def test_unset_variable_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NOPE", raising=False)
    for written in ("$NOPE/kv", "/x/${NOPE}/kv"):
        with pytest.raises(ConfigError, match=FIELD + r".*\$\{?NOPE\}? is not set in the environment"):
            load_config_text(config_text(written))
    with pytest.raises(ConfigError, match=r"^root_dir: .*\$NOPE is not set"):
        FileBackend("disk", 4, BLOCK, root_dir="$NOPE/kv", io="posix", fingerprint="test-model")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- per-user defaults
def test_shipped_configs_keep_the_tier_in_a_per_user_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"  # missing: kvtier creates it, and every directory below, 0700
    monkeypatch.setenv("HOME", str(home))
    configs = sorted(default_config_path().parent.glob("*.yaml"))
    roots = {p.name: cfg.tiers[1].options["root_dir"] for p in configs
             if len((cfg := load_config(p)).tiers) > 1 and cfg.tiers[1].backend == "file"}
    assert set(roots) == {"cpu-file.yaml", "replay-cpu-file.yaml", "vllm-cpu-file.yaml"}
    for name, root in roots.items():
        assert root.startswith(f"{home}/.cache/kvtier/"), (name, root)
    disk = FileBackend("disk", 4, BLOCK, root_dir=roots["cpu-file.yaml"], io="posix", fingerprint="test-model")
    try:
        disk.write_blocks([0], [keys(1)[0]], [payload(keys(1)[0])])
    finally:
        disk.close()
    created = Path(roots["cpu-file.yaml"])
    while created != tmp_path:
        assert mode(created) == 0o700, created
        created = created.parent


def test_failed_build_removes_what_it_created(tmp_path, monkeypatch):
    """A build failing with an OS error after creating directories and files removes them all
    (an existing parent stays) and names the field and the cause."""
    (tmp_path / "a").mkdir(mode=0o700)
    root = tmp_path / "a" / "b" / "c"

    def failing(*args, **kw):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Journal, "create", failing)
    with pytest.raises(ConfigError, match=FIELD + rf"file tier 'disk' cannot use {root}: .*Input/output error"):
        build(root)
    assert os.listdir(tmp_path / "a") == []
