"""The engine <-> file path choice: `auto` takes the direct (kvikio) path only under GPUDirect
Storage; an explicit `io` is honoured; the handler factory follows the choice and logs it once."""

from __future__ import annotations

import logging
import uuid

import pytest

from kvtier import CanonicalKVCaches, CanonicalKVCacheTensor
from kvtier.tiers.file import FileBackend, fileio
from kvtier.transfer.handlers import gpu_file, gpu_file_direct
from kvtier.transfer.handlers.file_path import PlatformFacts, choose_file_path, file_path, platform_facts

torch = pytest.importorskip("torch")

CLOUD_VM = PlatformFacts(cuda=True, kvikio=True, nvidia_fs=False)  # the H100 of issue 25
GDS = PlatformFacts(cuda=True, kvikio=True, nvidia_fs=True)


def test_auto_is_direct_only_where_gpudirect_storage_is_real():
    choice, why = choose_file_path("auto", CLOUD_VM)
    assert choice == "staged" and "no nvidia-fs driver" in why and "compatibility mode" in why
    assert choose_file_path("auto", GDS) == ("direct", "GPUDirect Storage: the nvidia-fs driver is loaded")
    assert choose_file_path("auto", PlatformFacts(True, False, True)) == ("staged", "kvikio does not import")
    assert choose_file_path("auto", PlatformFacts(False, True, True))[0] == "staged"


def test_an_explicit_io_is_honoured():
    choice, why = choose_file_path("kvikio", CLOUD_VM)
    assert choice == "direct" and "explicitly" in why and "compatibility mode" in why
    assert choose_file_path("kvikio", GDS)[0] == "direct"
    assert choose_file_path("posix", GDS) == ("staged", "io: posix")
    assert choose_file_path("kvikio", PlatformFacts(False, True, True))[0] == "staged"  # no CUDA: cannot
    with pytest.raises(ValueError, match="io 'gds' is not an I/O kind; use auto, posix or kvikio"):
        choose_file_path("gds", GDS)


@pytest.mark.parametrize("nvidia_fs", [False, True])
def test_the_platform_facts_come_from_the_driver_files(monkeypatch, nvidia_fs):
    present = {"/proc/modules"} | ({"/proc/driver/nvidia-fs/devcount"} if nvidia_fs else set())
    monkeypatch.setattr(fileio.os.path, "exists", lambda path: path in present)
    monkeypatch.setattr(fileio, "kvikio_importable", lambda: True)
    assert platform_facts(cuda=True) == PlatformFacts(True, True, nvidia_fs)
    assert file_path("auto", cuda=True)[0] == ("direct" if nvidia_fs else "staged")
    assert file_path("kvikio", cuda=True)[0] == "direct"


def test_without_cuda_kvikio_is_not_even_imported(monkeypatch):
    monkeypatch.setattr(fileio, "kvikio_importable", lambda: pytest.fail("kvikio probed without CUDA"))
    assert platform_facts(cuda=False) == PlatformFacts(False, False, False)
    assert file_path("kvikio", cuda=False) == ("staged", "the KV cache is not on a CUDA device")


def unseen(name: str) -> str:
    """A tier name no earlier test of this process logged: the log is once per (tier, choice, why)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def kv_caches():
    return CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros((8, 4096), dtype=torch.uint8), 4096)], None)


@pytest.mark.parametrize("io", ["auto", "kvikio", "posix"])
def test_the_factory_follows_the_choice_and_logs_it_once(tmp_path, monkeypatch, caplog, io):
    """With the facts of a GPU machine without nvidia-fs injected, `auto` builds the staged
    handler (it built the direct one before) and `kvikio` the direct one."""
    monkeypatch.setattr(gpu_file, "file_path", lambda io_, cuda: choose_file_path(io_, CLOUD_VM))
    name = unseen("nvme")
    backend = FileBackend(name, 8, 4096, root_dir=str(tmp_path / "nvme"), fingerprint="m",
                          io="posix" if io == "kvikio" else io)  # the tier's own I/O: no kvikio here
    backend.io_option = io
    try:
        with caplog.at_level(logging.INFO, logger="kvtier.transfer.handlers.file_path"):
            handlers = [gpu_file.make_gpu_to_file({name: backend}, kv_caches()),
                        gpu_file.make_file_to_gpu({name: backend}, kv_caches())]
        direct = io == "kvikio"
        assert all(isinstance(h, gpu_file_direct.DirectGPUFileHandler) == direct for h in handlers)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith(f"file tier {name}: engine<->file path "
                                                       f"{'direct' if direct else 'staged'} (")
        for h in handlers:
            h.shutdown()
    finally:
        backend.close()


def test_a_file_tier_records_its_configured_io(tmp_path):
    backend = FileBackend("nvme", 4, 4096, root_dir=str(tmp_path / "n"), fingerprint="m", io="posix")
    try:
        assert backend.io_option == "posix"
    finally:
        backend.close()


def test_a_tier_that_asked_for_direct_is_logged_staged_when_another_tier_makes_the_handler_staged(
        tmp_path, monkeypatch, caplog):
    """One handler serves every file tier: when one takes the staged path, the log line of a tier
    whose `io` asked for the direct one says staged too, and why."""
    monkeypatch.setattr(gpu_file, "file_path", lambda io_, cuda: choose_file_path(io_, CLOUD_VM))
    names = {"fast": unseen("fast"), "slow": unseen("slow")}
    fast = FileBackend(names["fast"], 8, 4096, root_dir=str(tmp_path / "fast"), fingerprint="m", io="posix")
    slow = FileBackend(names["slow"], 8, 4096, root_dir=str(tmp_path / "slow"), fingerprint="m", io="posix")
    fast.io_option = "kvikio"
    handler = None
    try:
        with caplog.at_level(logging.INFO, logger="kvtier.transfer.handlers.file_path"):
            handler = gpu_file.make_gpu_to_file({names["fast"]: fast, names["slow"]: slow}, kv_caches())
        assert type(handler) is gpu_file.GPUFileHandler
        lines = sorted(r.getMessage() for r in caplog.records)
        assert len(lines) == 2
        fast_name, slow_name = names["fast"], names["slow"]
        assert lines[0].startswith(f"file tier {fast_name}: engine<->file path staged (io: kvikio chosen explicitly")
        assert f"file tier {slow_name} takes the staged path" in lines[0]
        assert lines[1] == f"file tier {slow_name}: engine<->file path staged (io: posix)"
    finally:
        if handler is not None:
            handler.shutdown()
        fast.close()
        slow.close()
