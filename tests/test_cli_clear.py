"""`kvtier clear ROOT_DIR [--yes]`: removes a file tier's own files and nothing else, never while
the tier is open, never through a symlink. There was no such command on a8dbffc."""

from __future__ import annotations

import os

from kvtier import build_hierarchy, load_config_text
from kvtier.cli.main import main
from kvtier.tiers.rootdir import OWN_FILES, SLAB


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
    root = tmp_path / "tier"
    with build(root):
        code, _, err = clear(capsys, str(root), "--yes")
        assert code == 2 and "is a tier in use, nothing removed" in err and f"(pid {os.getpid()})" in err
        assert all((root / name).exists() for name in OWN_FILES)


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
