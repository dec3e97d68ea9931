"""`kvtier inspect --verify` on a file tier whose journal is there but cannot be read verifies
nothing (the journal lists the blocks to verify): it exits 1 and names the file and the reason, on
stderr and in the report's `verify_error`. Before the fix it reported `verified_ok 0`,
`verify_failed 0` and exited 0. The journal is made unreadable in ways that work as root too (a
directory, a FIFO, a dangling symlink in its place; no permission: chmod 000 as another user, an
EACCES from the open as root)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from kvtier import build_hierarchy, load_config_text
from kvtier.cli.main import main
from kvtier.core.keys import make_offload_key
from kvtier.tiers.file.inspection import inspect_root
from kvtier.tiers.file.rootdir import JOURNAL


def written_tier(root: Path) -> None:
    """A closed file tier in `root` holding two verified blocks."""
    yaml = ("block_bytes: 4KiB\ntiers:\n  - {name: hot, backend: memory, capacity: 4 blocks}\n"
            f"  - {{name: disk, backend: file, capacity: 4 blocks, root_dir: '{root}'}}\n")
    hierarchy = build_hierarchy(load_config_text(yaml), model="test-model")
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(2)]
    hierarchy.backends["disk"].write_blocks([0, 1], keys, [bytearray(b"%d" % i * 4096) for i in range(2)])
    hierarchy.close()


def replace_by_directory(path: Path, _monkeypatch) -> str:
    path.unlink()
    path.mkdir()
    return "not a regular file (a directory)"


def replace_by_fifo(path: Path, _monkeypatch) -> str:
    path.unlink()
    os.mkfifo(path)
    return "not a regular file (a FIFO)"


def replace_by_dangling_symlink(path: Path, _monkeypatch) -> str:
    path.unlink()
    path.symlink_to(path.parent / "no-such-file")
    return "not a regular file (a symbolic link)"


def deny_reading(path: Path, monkeypatch) -> str:
    """chmod 000 stops every user but root; as root, the open of `path` fails as it would for them."""
    path.chmod(0)
    if os.geteuid() == 0:
        real_open = os.open

        def open_denied(name, flags, *args, **kwargs):
            if os.fspath(name) == os.fspath(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(name))
            return real_open(name, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", open_denied)
    return os.strerror(errno.EACCES)


BREAKS = [replace_by_directory, replace_by_fifo, replace_by_dangling_symlink, deny_reading]


@pytest.mark.parametrize("breaks", BREAKS, ids=lambda f: f.__name__)
def test_verify_exits_1_naming_the_journal_it_could_not_read(tmp_path, capsys, monkeypatch, breaks):
    root = tmp_path / "tier"
    written_tier(root)
    assert main(["inspect", str(root), "--verify"]) == 0
    capsys.readouterr()
    why = breaks(root / JOURNAL, monkeypatch)
    code = main(["inspect", str(root), "--verify", "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    said = f"{root / JOURNAL} could not be read ({why}): the blocks it commits are unknown, none was verified"
    assert code == 1
    assert err.strip() == f"kvtier inspect: could not verify the tier: {said}"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verify_error"] == said and report["verified_ok"] == 0 and report["blocks"] == 0


def test_without_verify_an_unreadable_journal_is_reported_and_exits_0(tmp_path, capsys):
    root = tmp_path / "tier"
    written_tier(root)
    replace_by_directory(root / JOURNAL, None)
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "journal unreadable: not a regular file (a directory)" in out and "verify_error" not in out


def test_a_missing_journal_is_no_verify_error(tmp_path):
    """Without a journal the tier holds no committed block (its next start rebuilds it empty):
    there is nothing left unverified."""
    root = tmp_path / "tier"
    written_tier(root)
    (root / JOURNAL).unlink()
    report = inspect_root(str(root), verify=True)
    assert "verify_error" not in report and report["verified_ok"] == report["verify_failed"] == 0
    assert "journal unreadable: No such file or directory" in report["index_health"]
