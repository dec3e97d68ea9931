"""`kvtier inspect`: sizes in units, the lock's state in words (a clean close is not a dead
holder), exit 2 on a directory that is no tier, exit 1 when `--verify` finds a bad block; and the
"root_dir in use" error names the process, not "another user". All of these differed on a8dbffc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import build_hierarchy, load_config_text
from kvtier.cli.inspect import human_size
from kvtier.cli.main import main
from kvtier.core.errors import KVTierError
from kvtier.tiers.file.rootdir import SLAB

REPO = Path(__file__).resolve().parents[1]


def tier_yaml(root: Path) -> str:
    return ("block_bytes: 4KiB\ntiers:\n  - {name: hot, backend: memory, capacity: 4 blocks}\n"
            f"  - {{name: disk, backend: file, capacity: 4 blocks, root_dir: '{root}'}}\n")


def build(root: Path):
    return build_hierarchy(load_config_text(tier_yaml(root)), model="test-model")


def inspect(capsys, *argv: str) -> tuple[int, dict[str, str], str]:
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    rows = dict(line.split(None, 1) for line in out.splitlines() if line.strip())
    return code, rows, err


def test_sizes_are_printed_in_units_and_kept_in_bytes_in_json(tmp_path, capsys):
    root = tmp_path / "tier"
    build(root).close()
    code, rows, _ = inspect(capsys, str(root), "--json", str(tmp_path / "r.json"))
    assert code == 0
    assert rows["block_bytes"] == "4 KiB" and rows["slot_bytes"] == "8 KiB" and rows["slab_bytes"] == "32 KiB"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["block_bytes"] == 4096 and report["slab_bytes"] == 32768


def test_human_size():
    assert [human_size(n) for n in (None, 0, 1023, 1024, 1536, 3 << 30, (1 << 40) + (1 << 39))] == \
        ["-", "0 B", "1023 B", "1 KiB", "1.5 KiB", "3 GiB", "1.5 TiB"]


def test_open_clean_close_and_dead_holder_are_told_apart(tmp_path, capsys):
    root = tmp_path / "tier"
    hierarchy = build(root)
    assert inspect(capsys, str(root))[1]["lock"] == f"open by process {os.getpid()}"
    hierarchy.close()
    assert inspect(capsys, str(root))[1]["lock"] == "not open (closed cleanly)"
    script = ("import os, sys; from kvtier import build_hierarchy, load_config_text; "
              f"build_hierarchy(load_config_text({tier_yaml(root)!r}), model='test-model'); "
              "print(os.getpid(), flush=True); os._exit(0)")  # dies holding the tier, never closes it
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    pid = proc.stdout.split()[-1]
    lock = inspect(capsys, str(root))[1]["lock"]
    assert lock.startswith(f"not open: stale lock of process {pid}, which ended without closing the tier")


def test_an_open_tier_is_told_open_where_proc_locks_names_another_device(tmp_path, capsys, monkeypatch):
    """On btrfs /proc/locks names the filesystem by another device number than stat's st_dev (a
    device per subvolume): the lock is still found by its inode, so the open tier is open."""
    from kvtier.tiers.file import inspection
    from kvtier.tiers.file.rootdir import LOCK

    root = tmp_path / "tier"
    hierarchy = build(root)
    try:
        st = os.lstat(root / LOCK)
        other = f"{os.major(st.st_dev) + 1:02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        locks = tmp_path / "locks"
        locks.write_text(f"1: FLOCK  ADVISORY  WRITE {os.getpid()} {other} 0 EOF\n")
        monkeypatch.setattr(inspection, "PROC_LOCKS", str(locks))
        assert inspect(capsys, str(root))[1]["lock"] == f"open by process {os.getpid()}"
    finally:
        hierarchy.close()


def test_a_directory_that_is_no_tier_exits_2(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a tier")
    code, _, err = inspect(capsys, str(tmp_path))
    assert code == 2 and "is not a file tier's root_dir" in err


def test_verify_exits_1_when_a_block_fails(tmp_path, capsys):
    root = tmp_path / "tier"
    hierarchy = build(root)
    disk = hierarchy.backends["disk"]
    from kvtier.core.keys import make_offload_key

    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(2)]
    disk.write_blocks([0, 1], keys, [bytearray(b"%d" % i * 4096) for i in range(2)])
    hierarchy.close()
    assert inspect(capsys, str(root), "--verify")[0] == 0
    with open(root / SLAB, "r+b") as slab:  # flip a payload byte of slot 1
        slab.seek(disk.slot_bytes + disk.slot_bytes - 100)
        byte = slab.read(1)
        slab.seek(-1, 1)
        slab.write(bytes([byte[0] ^ 0xFF]))
    code, rows, err = inspect(capsys, str(root), "--verify", "--json", str(tmp_path / "r.json"))
    assert code == 1 and rows["verified_ok"] == "1" and rows["verify_failed"] == "1"
    # issue 36.12: the failed block is named by its key (a user has keys, not slots), and its slot
    assert f"1 block(s) failed verification: key {'01' * 16} group 0 (slot 1): payload checksum mismatch" in err
    [failure] = json.loads((tmp_path / "r.json").read_text())["failures"]
    assert failure == {"key": keys[1].hex(), "slot": 1, "reason": "payload checksum mismatch"}


def test_a_second_opener_of_the_same_user_is_told_the_pid_not_another_user(tmp_path):
    root = tmp_path / "tier"
    with build(root):
        with pytest.raises(KVTierError) as info:
            build(root)
    message = str(info.value)
    assert f"is in use by another process of yours (pid {os.getpid()});" in message and "another user" not in message
