"""`kvtier clear ROOT_DIR [--yes]`: removes a file tier's own files and nothing else, never while
the tier is open, never through a symlink. There was no such command on a8dbffc."""

from __future__ import annotations

import os

from kvtier import build_hierarchy, load_config_text
from kvtier.cli import clear as clear_module
from kvtier.cli.main import main
from kvtier.tiers.file.rootdir import OWN_FILES, SLAB


def build(root):
    return build_hierarchy(load_config_text("block_bytes: 4KiB\ntiers:\n  - {name: hot, backend: memory, capacity: "
                                            f"4 blocks}}\n  - {{name: disk, backend: file, capacity: 4 blocks, "
                                            f"root_dir: '{root}'}}\n"), model="test-model")


def clear(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["clear", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_without_yes_nothing_is_removed_and_with_it_only_the_tiers_files(tmp_path, capsys):
    root = tmp_path / "tier"
    build(root).close()
    (root / "notes.txt").write_text("mine")
    code, out, _ = clear(capsys, str(root))
    assert code == 2 and "would remove" in out and "slab.0 (32 KiB)" in out and "nothing removed" in out
    assert all((root / name).exists() for name in OWN_FILES)
    code, out, err = clear(capsys, str(root), "--yes")
    assert code == 0, err
    assert sorted(os.listdir(root)) == ["notes.txt"] and "the directory itself is left" in out
    build(root).close()  # the directory is usable again


def test_an_open_tier_is_refused(tmp_path, capsys):
    """With --yes, and in a dry run too (before, the dry run said "would remove ... run again with
    --yes", which was then refused)."""
    root = tmp_path / "tier"
    with build(root):
        for flags in (["--yes"], []):
            code, out, err = clear(capsys, str(root), *flags)
            assert code == 2 and "is a tier in use, nothing removed" in err and f"(pid {os.getpid()})" in err
            assert "would remove" not in out
            assert all((root / name).exists() for name in OWN_FILES)


def test_a_dry_run_leaves_no_lock_behind(tmp_path, capsys):
    root = tmp_path / "tier"
    build(root).close()
    os.unlink(root / "lock")
    before = sorted(os.listdir(root))
    code, out, _ = clear(capsys, str(root))
    assert code == 2 and "would remove" in out and sorted(os.listdir(root)) == before


def test_a_directory_that_is_no_tier_or_a_symlink_is_refused(tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data").write_text("keep")
    code, _, err = clear(capsys, str(plain), "--yes")
    assert code == 2 and "is not a file tier's root_dir" in err and (plain / "data").exists()
    root = tmp_path / "tier"
    build(root).close()
    os.symlink(root, tmp_path / "link")
    code, _, err = clear(capsys, str(tmp_path / "link"), "--yes")
    assert code == 2 and "is a symlink" in err and (root / SLAB).exists()


def test_a_symlink_in_the_tier_is_removed_itself_never_followed(tmp_path, capsys):
    root = tmp_path / "tier"
    build(root).close()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.unlink(root / SLAB)
    os.symlink(victim, root / SLAB)
    code, out, err = clear(capsys, str(root), "--yes")
    assert code == 0, err
    assert not os.path.lexists(root / SLAB) and victim.read_text() == "precious"


def test_a_directory_under_a_tier_name_is_refused(tmp_path, capsys):
    root = tmp_path / "tier"
    build(root).close()
    os.unlink(root / SLAB)
    (root / SLAB).mkdir()
    (root / SLAB / "x").write_text("keep")
    code, _, err = clear(capsys, str(root), "--yes")
    assert code == 2 and "is a directory, not a file kvtier wrote" in err
    assert (root / SLAB / "x").exists() and all((root / n).exists() for n in OWN_FILES)


def test_files_that_merely_carry_the_tiers_names_are_refused(tmp_path, capsys):
    """Another program's `lock`, `journal` and `manifest.json` are no tier: nothing is removed."""
    other = tmp_path / "webapp"
    other.mkdir()
    for name, text in (("lock", "42\n"), ("journal", "2026-11-27 deployed\n"), ("manifest.json", '{"name": "app"}')):
        (other / name).write_text(text)
    for argv in ((str(other),), (str(other), "--yes")):
        code, _, err = clear(capsys, *argv)
        assert code == 2 and "neither a kvtier manifest.json nor a kvtier journal" in err
    assert sorted(os.listdir(other)) == ["journal", "lock", "manifest.json"]


def test_a_tier_without_a_readable_manifest_is_still_cleared_by_its_journal(tmp_path, capsys):
    root = tmp_path / "tier"
    build(root).close()
    (root / "manifest.json").write_text("garbage{")
    code, _, err = clear(capsys, str(root), "--yes")
    assert code == 0, err
    assert os.listdir(root) == []


def test_a_root_swapped_for_a_symlink_after_the_checks_loses_nothing_elsewhere(tmp_path, capsys, monkeypatch):
    """The race: ROOT_DIR is replaced by a symlink to another tier between the checks and the
    removal; that other tier's files must stay."""
    root, victim = tmp_path / "tier", tmp_path / "victim"
    build(root).close()
    build(victim).close()
    taken = clear_module.RootLock

    def swap_then_lock(*args):
        os.rename(root, tmp_path / "moved")
        os.symlink(victim, root)
        return taken(*args)

    monkeypatch.setattr(clear_module, "RootLock", swap_then_lock)
    code, _, err = clear(capsys, str(root), "--yes")
    assert code == 2 and "was replaced by another directory" in err
    assert all((victim / name).exists() for name in OWN_FILES if name != "lock")
    assert all((tmp_path / "moved" / name).exists() for name in OWN_FILES if name != "lock")


def test_another_users_directory_is_refused(tmp_path, capsys):
    root = tmp_path / "tier"
    build(root).close()
    os.chown(root, 65534, 65534)  # nobody (the tests run as root)
    code, _, err = clear(capsys, str(root), "--yes")
    assert code == 2 and f"{root} is owned by uid 65534 (nobody) (mode 0700), not by you" in err
    assert "nothing removed" in err
    assert all((root / name).exists() for name in OWN_FILES)


def test_an_empty_root_dir_is_refused_not_taken_for_the_current_directory(tmp_path, capsys, monkeypatch):
    """`kvtier clear "$ROOT" --yes` with ROOT unset: before, "" was Path(".") and the tier in the
    current directory was cleared."""
    build(tmp_path).close()
    monkeypatch.chdir(tmp_path)
    code, _, err = clear(capsys, "", "--yes")
    assert code == 2 and "ROOT_DIR is empty" in err
    assert all((tmp_path / name).exists() for name in OWN_FILES)


def test_a_removal_that_fails_is_a_clear_error_naming_what_is_left(tmp_path, capsys, monkeypatch):
    """An unlink refused by the OS (a read-only directory, I/O) ends in one message and exit 2,
    not a traceback, saying what was removed before it and what is left."""
    root = tmp_path / "tier"
    build(root).close()
    real = os.unlink

    def unlink(name, *, dir_fd=None):
        if name == SLAB:
            raise PermissionError(13, "Permission denied")
        real(name, dir_fd=dir_fd)

    monkeypatch.setattr(clear_module.os, "unlink", unlink)
    code, _, err = clear(capsys, str(root), "--yes")
    assert code == 2
    assert f"cannot remove {root / SLAB}: Permission denied; removed before it: " in err
    assert "; left: slab.0, " in err and err.rstrip().endswith("lock")
    assert (root / SLAB).exists() and (root / "lock").exists()
