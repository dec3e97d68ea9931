"""Which directory `kvtier bench hops` measures: an unusable --root-dir is refused up front (exit 2,
nothing created), and without one the output says which directory and why."""

from __future__ import annotations

import os
import time

import pytest

from kvtier import load_config_text
from kvtier.bench import where
from kvtier.bench.where import RootDirError, check_root_dir, file_hops_place
from kvtier.cli.main import main
from kvtier.tiers.file.mounts import filesystem_of


def _config(root_dir: str | None):
    disk = f'\n  - {{name: disk, backend: file, capacity: 16 blocks, root_dir: "{root_dir}"}}' if root_dir else ""
    memory = "{name: cpu, backend: memory, capacity: 8 blocks}"
    return load_config_text(f"block_bytes: 4KiB\ntiers:\n  - {memory}{disk}\n")


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing" / "dir", "no such directory"),
    (lambda p: (p / "file").write_text("x") and p / "file", "not a directory"),
    (lambda p: "/proc/self", "on a proc filesystem (/proc)"),
])
def test_an_unusable_root_dir_is_refused_before_anything_runs(tmp_path, capsys, make, message):
    root = make(tmp_path)
    start = time.perf_counter()
    assert main(["bench", "hops", "--root-dir", str(root), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--root-dir: {root}: {message}" in err and "existing, writable directory" in err
    assert "Traceback" not in err and time.perf_counter() - start < 5
    assert not (tmp_path / "missing").exists()  # never created


def test_a_directory_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(where.tempfile, "mkstemp", refuse)
    with pytest.raises(RootDirError, match="cannot create a file there \\(Permission denied\\)"):
        check_root_dir(str(tmp_path))


def test_a_usable_root_dir_leaves_nothing_behind(tmp_path):
    assert check_root_dir(str(tmp_path)) == os.path.realpath(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_mount_holding_a_path_is_the_longest_prefix(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("rootfs / rootfs rw 0 0\n/dev/vda / ext4 rw 0 0\ntmpfs /data\\040x tmpfs rw 0 0\n"
                      "/dev/nvme0n1 /data xfs rw 0 0\n")
    assert filesystem_of("/data/kv/slabs", str(mounts)) == {"fstype": "xfs", "mount_point": "/data",
                                                             "device": "/dev/nvme0n1"}
    assert filesystem_of("/data x/a", str(mounts))["fstype"] == "tmpfs"
    assert filesystem_of("/database", str(mounts))["fstype"] == "ext4"
    assert filesystem_of("/x", str(tmp_path / "none"))["fstype"] is None


def test_without_root_dir_the_config_file_tier_decides_and_says_so(tmp_path):
    # The shipped configs name ~/.cache/kvtier/<tier>: on a fresh machine none of it exists yet.
    root = tmp_path / "home" / ".cache" / "kvtier" / "nvme"
    place = file_hops_place(_config(str(root)), None)
    assert place["parent"] == str(tmp_path)
    assert place["reason"] == (f"next to the root_dir of tier 'disk', {root} (so on its filesystem); "
                               f"--root-dir DIR measures elsewhere")
    (tmp_path / "home" / ".cache").mkdir(parents=True)
    assert file_hops_place(_config(str(root)), None)["parent"] == str(tmp_path / "home" / ".cache")


def test_without_a_file_tier_the_temporary_directory_is_named_with_the_reason():
    place = file_hops_place(_config(None), None)
    assert place["reason"].startswith("the temporary directory: the config has no file tier with a root_dir")
    assert where.describe(place).startswith(f"file hops measured in {place['parent']} (")


def test_the_file_hops_never_write_through_a_name_planted_in_a_shared_root_dir(tmp_path):
    """`python -m kvtier.bench.file_hops` measures in /tmp by default. Before, it worked in
    `ROOT/kvtier-bench-<pid>` (reused if present) and its raw baseline opened `raw` there
    following links: a neighbour who planted that directory with `raw` -> one of your files had
    the bench's bytes written into it."""
    from kvtier.bench.file_hops import measure_cpu_file

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 512)
    planted = tmp_path / f"kvtier-bench-{os.getpid()}"
    planted.mkdir()
    os.symlink(victim, planted / "raw")
    measure_cpu_file(str(tmp_path), 4096, 64 << 10, repeats=1, host="memory")
    assert victim.read_bytes() == b"precious" * 512
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", planted.name])  # its own directory is removed


def test_a_cpu_side_that_cannot_be_built_leaves_no_directory(tmp_path, monkeypatch):
    """A shared-memory region that does not fit (a small /dev/shm) fails the measurement before
    any directory is made in root_dir (before, an empty kvtier-bench-* directory stayed)."""
    from kvtier.bench.file_hops import measure_cpu_file
    from kvtier.tiers import cpu

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cpu, "CPUBackend", no_room)
    with pytest.raises(OSError, match="No space left"):
        measure_cpu_file(str(tmp_path), 4096, 64 << 10, repeats=1, host="cpu")
    assert os.listdir(tmp_path) == []


def test_a_file_tier_under_a_kernel_filesystem_is_refused_by_name(tmp_path, capsys):
    """Before: a root_dir under /proc was said to be "created in /proc", and the problem blamed
    was the capacity ("does not fit ... (0B free)"); building the tier said the same."""
    from kvtier import build_hierarchy
    from kvtier.core.errors import ConfigError

    path = tmp_path / "proc.yaml"
    text = ("block_bytes: 1MiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n"
            "  - {name: nvme, backend: file, capacity: 64MiB, root_dir: /proc/kvtier-test}\n")
    path.write_text(text)
    assert main(["config", "check", "--env", str(path)]) == 2
    assert "tiers[1].root_dir: /proc/kvtier-test: on a proc filesystem" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="a kernel interface where no file tier can live"):
        build_hierarchy(load_config_text(text), model="test-model")
