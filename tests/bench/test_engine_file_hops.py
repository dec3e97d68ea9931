"""engine <-> FILE hop rows: the staged handler (and the direct one, on kvikio's host path here),
each beside a raw O_DIRECT + copy baseline, byte-verified after measuring."""

from __future__ import annotations

import pytest

from kvtier.bench.engine_file_hops import measure_engine_file
from kvtier.bench.hops import TransferCorrupted
from kvtier.bench.hops_runner import engine_file_paths, hop_label

pytest.importorskip("torch")


def test_staged_rows_are_measured_against_raw_io_plus_a_copy_and_verified(tmp_path):
    rows = measure_engine_file(str(tmp_path), "cpu", 64 << 10, 1 << 20, repeats=2, paths=["staged"])
    assert [(r["hop"], r["path"], r["baseline"]) for r in rows] == [
        ("GPU->FILE", "staged", "raw O_DIRECT write+copy"), ("FILE->GPU", "staged", "raw O_DIRECT read+copy")]
    for row in rows:
        assert row["verified"] and len(row["samples_gbps"]) == 2 and len(row["baseline_samples_gbps"]) == 2
        assert row["total_bytes"] == 16 * (64 << 10)
    assert [hop_label(r) for r in rows] == ["engine->FILE staged", "FILE->engine staged"]
    assert list(tmp_path.iterdir()) == []


def test_the_direct_path_runs_through_the_same_measurement(tmp_path):
    from kvtier.tiers.file import fileio

    if not fileio.kvikio_importable():
        pytest.skip("kvikio not installed")
    from tests.support.fake_cuda import load_fake_libcuda

    load_fake_libcuda()
    rows = measure_engine_file(str(tmp_path), "cpu", 64 << 10, 1 << 20, repeats=1, paths=["direct"])
    assert [(r["hop"], r["path"], r["verified"]) for r in rows] == [("GPU->FILE", "direct", True),
                                                                     ("FILE->GPU", "direct", True)]


def test_a_load_that_corrupts_bytes_raises(tmp_path, monkeypatch):
    from kvtier.tiers.file import FileBackend

    real = FileBackend.read_blocks

    def corrupt(self, slots, keys, buffers):
        done = real(self, slots, keys, buffers)  # read and verified: the bytes go wrong on the way to the engine
        buffers[0][0] ^= 0xFF
        return done

    monkeypatch.setattr(FileBackend, "read_blocks", corrupt)
    with pytest.raises(TransferCorrupted, match="engine<->FILE \\(staged\\) with 65536-byte blocks moved wrong"):
        measure_engine_file(str(tmp_path), "cpu", 64 << 10, 1 << 20, repeats=1, paths=["staged"])


def test_without_cuda_one_line_says_why_direct_is_not_measured():
    paths, why = engine_file_paths("cpu")
    assert paths == ["staged"] and why is not None and "direct (kvikio) not measured" in why and "CUDA" in why


def test_a_raw_file_that_cannot_be_allocated_leaves_no_directory_and_no_descriptor(tmp_path, monkeypatch):
    import errno
    import os

    from kvtier.bench import engine_file_hops

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine_file_hops.os, "posix_fallocate", full)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="No space left"):
        measure_engine_file(str(tmp_path), "cpu", 64 << 10, 1 << 20, repeats=1, paths=["staged"])
    assert list(tmp_path.iterdir()) == []
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_handler_that_cannot_be_built_leaves_the_file_tier_closed(tmp_path, monkeypatch):
    """The load handler failing to build (kvikio cannot open the slab, say) closes the store
    handler and the file tier: no descriptor of the tier stays open, no lock stays held."""
    import os

    from kvtier.transfer.handlers import gpu_file

    real_init, shut = gpu_file.GPUFileHandler.__init__, []

    def init(self, backends, layout, to_file, **kwargs):
        if not to_file:
            raise OSError(5, "Input/output error")
        real_init(self, backends, layout, to_file, **kwargs)

    real_shutdown = gpu_file.GPUFileHandler.shutdown

    def shutdown(self):
        shut.append(self.to_file)
        real_shutdown(self)

    monkeypatch.setattr(gpu_file.GPUFileHandler, "__init__", init)
    monkeypatch.setattr(gpu_file.GPUFileHandler, "shutdown", shutdown)
    with pytest.raises(OSError, match="Input/output error"):
        measure_engine_file(str(tmp_path), "cpu", 64 << 10, 1 << 20, repeats=1, paths=["staged"])
    assert shut == [True]
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [path for path in held if path.startswith(str(tmp_path))]
