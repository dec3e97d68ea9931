"""CPUBackend: the shared-memory CPU tier."""

from __future__ import annotations

import mmap
import os
import stat
import subprocess
import sys

import pytest

from kvtier import ConfigError, build_hierarchy, load_config_text
from kvtier.tiers.cpu import CPUBackend

torch = pytest.importorskip("torch")


@pytest.fixture
def backend():
    b = CPUBackend("cpu", 5, 5000)
    yield b
    b.close()


def test_region_is_a_private_shm_file_of_exact_size(backend):
    st = os.stat(backend.path)
    assert backend.path.startswith("/dev/shm/")
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert backend.slot_stride % mmap.PAGESIZE == 0 and backend.slot_stride >= 5000
    assert backend.header_bytes == mmap.PAGESIZE
    assert st.st_size == backend.header_bytes + 5 * backend.slot_stride  # capacity exactly as configured
    assert backend.data_ptr() % mmap.PAGESIZE == 0  # slots stay page-aligned after the header page
    assert backend.tensor().data_ptr() == backend.data_ptr()
    assert backend.owner_pid() == os.getpid()


def test_view_and_tensor_share_bytes_without_copies(backend):
    backend.view(3)[:4] = b"abcd"
    t = backend.tensor()
    assert t.shape == (5, 5000) and t.stride() == (backend.slot_stride, 1) and t.dtype == torch.uint8
    assert bytes(t[3, :4]) == b"abcd"
    t[4, -3:] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert bytes(backend.view(4)[-3:]) == b"\x01\x02\x03"
    assert len(backend.view(0)) == 5000
    with pytest.raises(IndexError):
        backend.view(5)


def test_another_process_attaches_by_name(backend):
    backend.view(2)[:] = bytes(range(256)) * 19 + bytes(136)
    code = (
        "import sys; from kvtier.tiers.cpu import CPUBackend\n"
        f"b = CPUBackend.attach({backend.shm_name!r}, 5, 5000, pin='false')\n"
        "ok = bytes(b.view(2)) == bytes(range(256)) * 19 + bytes(136)\n"
        "b.view(1)[:5] = b'child'\n"
        "b.close(); sys.exit(0 if ok else 3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert bytes(backend.view(1)[:5]) == b"child"
    assert os.path.exists(backend.path)  # the attached process does not remove the creator's file


def test_close_removes_region_and_is_idempotent():
    b = CPUBackend("cpu", 2, 4096, shm_name=f"kvtier-test-{os.getpid()}")
    assert b.path == f"/dev/shm/kvtier-test-{os.getpid()}"
    b.tensor()  # a live tensor must not prevent removal
    b.close()
    b.close()
    assert not os.path.exists(b.path)


def test_attach_checks_geometry(backend):
    with pytest.raises(ValueError, match="expected"):
        CPUBackend.attach(backend.shm_name, 6, 5000)
    with pytest.raises(FileNotFoundError):
        CPUBackend.attach("kvtier-does-not-exist", 1, 10)


def test_existing_name_is_not_clobbered(backend):
    with pytest.raises(FileExistsError):
        CPUBackend("other", 1, 10, shm_name=backend.shm_name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_pinning_without_cuda():
    b = CPUBackend("cpu", 1, 64)  # auto: plain memory
    assert not b.pinned
    b.close()
    before = {n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-{os.getpid()}-")}
    with pytest.raises(RuntimeError, match="CUDA"):
        CPUBackend("cpu", 1, 64, pin="true")
    assert {n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-{os.getpid()}-")} == before  # none left


def test_yaml_options_and_errors(tmp_path):
    name = f"kvtier-yaml-{os.getpid()}"
    cfg = load_config_text(f"""
block_bytes: 8KiB
tiers:
  - {{name: cpu, backend: cpu, capacity: 64KiB, shm_name: {name}, pin: false}}
""")
    with build_hierarchy(cfg) as h:
        cpu = h.backends["cpu"]
        assert isinstance(cpu, CPUBackend) and cpu.num_blocks == 8 and cpu.shm_name == name and not cpu.pinned
        assert os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.pin"):
        load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 1MiB, pin: maybe}\n")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.shm_name"):
        load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 1MiB, shm_name: a/b}\n")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_region_is_pinned_with_cuda():
    b = CPUBackend("cpu", 4, 1 << 20)
    try:
        assert b.pinned
        t = b.tensor()
        gpu = torch.arange(1 << 20, device="cuda").to(torch.uint8)
        t[1].copy_(gpu, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(t[1], gpu.cpu())
    finally:
        b.close()
