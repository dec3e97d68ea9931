"""Engine KV cache <-> file tier (direct path) handlers."""

from __future__ import annotations

import os

import pytest
from conftest import Jobs

from kvtier import CanonicalKVCacheRef, CanonicalKVCacheTensor, FileLoadStoreSpec, GPULoadStoreSpec
from kvtier.core.errors import BlocksFailed
from kvtier.tiers.file import FileBackend
from kvtier.transfer.handlers.gpu_cpu import ChunkedKVCaches, KVLayout
from kvtier.transfer.handlers.gpu_file import aligned_rows, make_file_to_gpu, make_gpu_to_file

torch = pytest.importorskip("torch")


def make_kv(device="cpu", bpc=1):
    g = torch.Generator().manual_seed(1)
    t0 = torch.randint(-128, 128, (16, 4096 + 512), dtype=torch.int8, generator=g).to(device)  # stride > page
    t1 = torch.randint(-128, 128, (16, 2048), dtype=torch.int8, generator=g).to(device)
    return ChunkedKVCaches([CanonicalKVCacheTensor(t0, 4096), CanonicalKVCacheTensor(t1, 2048)],
                           [[CanonicalKVCacheRef(0, 4096), CanonicalKVCacheRef(1, 2048)],
                            [CanonicalKVCacheRef(1, 2048), CanonicalKVCacheRef(0, 4096)]], bpc)


def keys(n, start=0):
    return [(i + start).to_bytes(8, "big") + b"\0\0\0\0" for i in range(n)]


@pytest.fixture
def setup(tmp_path):
    made = []

    def make(kv, backend=None):
        layout = KVLayout(kv, kv.blocks_per_chunk)
        if backend is None:
            backend = FileBackend("nvme", 16, layout.block_bytes, root_dir=str(tmp_path / "nvme"),
                                  fingerprint="test-model")
        store, load = make_gpu_to_file({"nvme": backend}, kv), make_file_to_gpu({"nvme": backend}, kv)
        jobs = Jobs(store, load)
        made.append((jobs, backend))
        return layout, backend, store, load, jobs
    yield make
    for jobs, backend in made:
        jobs.close()
        backend.close()


def test_roundtrip_through_the_file_tier(setup):
    kv = make_kv(bpc=2)
    layout, backend, store, load, jobs = setup(kv)
    src = GPULoadStoreSpec([1, 2, 3, 4, 5, 6], group_sizes=[3, 3], block_indices=[1, 0])  # 2 + 2 slots
    file_spec = FileLoadStoreSpec([7, 2, 11, 4], keys(4), tier="nvme")
    r = jobs.run(store, 1, src, file_spec)
    assert r.success, r.error
    assert r.transfer_size == 6 * (4096 + 2048)
    before = [t.tensor.clone() for t in kv.tensors]
    for t in kv.tensors:
        t.tensor.zero_()
    dst = GPULoadStoreSpec([10, 11, 12, 13, 14, 15], group_sizes=[3, 3], block_indices=[1, 0])
    r = jobs.run(load, 2, file_spec, dst)
    assert r.success, r.error
    for t_idx, page in enumerate((4096, 2048)):
        assert torch.equal(kv.tensors[t_idx].tensor[10:16, :page], before[t_idx][1:7, :page])
        assert int(kv.tensors[t_idx].tensor[:10].abs().sum()) == 0


def test_wrong_keys_fail_their_blocks_and_leave_the_engine_untouched(setup):
    kv = make_kv()
    layout, backend, store, load, jobs = setup(kv)
    assert jobs.run(store, 1, GPULoadStoreSpec([1, 2], group_sizes=[2, 0]),
                    FileLoadStoreSpec([0, 1], keys(2), tier="nvme")).success
    snapshot = [t.tensor.clone() for t in kv.tensors]
    bad = jobs.run(load, 2, FileLoadStoreSpec([0, 1], keys(2, start=5), tier="nvme"),
                   GPULoadStoreSpec([8, 9], group_sizes=[2, 0]))
    assert not bad.success and bad.failed_blocks == (0, 1) and "failed verification" in bad.error
    assert all(torch.equal(a.tensor, b) for a, b in zip(kv.tensors, snapshot))


def test_a_corrupt_block_fails_alone_and_the_others_are_loaded(setup):
    """One payload byte changed on disk: that block fails (named by position, forgotten by the
    tier, its engine pages untouched); the job's other blocks are loaded, byte-exact."""
    kv = make_kv()
    layout, backend, store, load, jobs = setup(kv)
    spec = FileLoadStoreSpec([3, 4, 5], keys(3), tier="nvme")
    assert jobs.run(store, 1, GPULoadStoreSpec([1, 2, 3], group_sizes=[3, 0]), spec).success
    _flip_payload_byte(backend, 4)
    before = [t.tensor.clone() for t in kv.tensors]
    result = jobs.run(load, 2, spec, GPULoadStoreSpec([8, 9, 10], group_sizes=[3, 0]))
    assert not result.success and result.failed_blocks == (1,) and "slot 4" in result.error
    assert result.transfer_size == 2 * (4096 + 2048)
    for t_idx, page in enumerate((4096, 2048)):
        t = kv.tensors[t_idx].tensor
        assert torch.equal(t[8, :page], before[t_idx][1, :page]) and torch.equal(t[10, :page], before[t_idx][3, :page])
        assert torch.equal(t[9], before[t_idx][9])  # the bad block's page: untouched
    assert sorted(backend.committed()) == [3, 5]


class FlakyBackend:
    """The byte API of FileBackend over a dict (a `BlockFile`); fails writes to slot 13."""

    num_threads = 2

    def __init__(self, block_bytes):
        self.name, self.block_bytes, self.data = "nvme", block_bytes, {}

    def write_blocks(self, slots, keys, buffers):
        if 13 in slots:
            raise OSError(28, "No space left on device")
        for s, k, b in zip(slots, keys, buffers):
            self.data[s] = (k, bytes(memoryview(b)))
        return len(slots) * self.block_bytes

    def read_blocks(self, slots, keys, buffers):
        for s, b in zip(slots, buffers):
            memoryview(b).cast("B")[:] = self.data[s][1]
        return len(slots) * self.block_bytes

    def close(self):
        pass


def test_an_io_error_fails_only_its_job(setup):
    kv = make_kv()
    layout, backend, store, load, jobs = setup(kv, FlakyBackend(KVLayout(kv, 1).block_bytes))
    bad = jobs.run(store, 1, GPULoadStoreSpec([1], group_sizes=[1, 0]), FileLoadStoreSpec([13], keys(1), tier="nvme"))
    assert not bad.success and "No space" in bad.error
    good = jobs.run(store, 2, GPULoadStoreSpec([2], group_sizes=[0, 1]), FileLoadStoreSpec([3], keys(1), tier="nvme"))
    assert good.success
    # group 1 layout: tensor 1's page first, then tensor 0's
    assert backend.data[3][1][:2048] == kv.tensors[1].tensor[2].numpy().tobytes()
    assert backend.data[3][1][2048:] == kv.tensors[0].tensor[2, :4096].numpy().tobytes()


def test_factories_and_staging_alignment():
    kv = make_kv()
    assert make_gpu_to_file({}, kv) is None
    assert make_file_to_gpu({"x": FlakyBackend(10)}, None) is None
    rows = aligned_rows(3, 5000)
    assert rows.shape == (3, 8192) and rows.is_contiguous()
    assert all(rows[i].data_ptr() % 4096 == 0 for i in range(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_roundtrip_through_the_file_tier(setup):
    kv = make_kv(device="cuda", bpc=2)
    layout, backend, store, load, jobs = setup(kv)
    src = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4, 0], block_indices=[0, 0])
    spec = FileLoadStoreSpec([5, 6], keys(2), tier="nvme")
    assert jobs.run(store, 1, src, spec).success
    before = [t.tensor.clone() for t in kv.tensors]
    r = jobs.run(load, 2, spec, GPULoadStoreSpec([9, 10, 11, 12], group_sizes=[4, 0], block_indices=[0, 0]))
    assert r.success, r.error
    for t_idx, page in enumerate((4096, 2048)):
        assert torch.equal(kv.tensors[t_idx].tensor[9:13, :page], before[t_idx][1:5, :page])


# ------------------------------------------------------------------ direct path (kvikio) on CPU tensors
@pytest.fixture
def direct(tmp_path):
    """Direct handlers over a real file tier, kvikio on its host path (stand-in libcuda)."""
    from kvtier.tiers.file import fileio

    if not fileio.kvikio_importable():
        pytest.skip("kvikio not installed (CI installs it: see docs/gds.md)")
    from kvtier.transfer.handlers.gpu_file_direct import DirectGPUFileHandler
    from tests.support.fake_cuda import load_fake_libcuda

    load_fake_libcuda()
    made = []

    def make(kv, num_blocks=16):
        layout = KVLayout(kv, kv.blocks_per_chunk)
        backend = FileBackend("nvme", num_blocks, layout.block_bytes, root_dir=str(tmp_path / "nvme"),
                              fingerprint="test-model", io="posix")
        store = DirectGPUFileHandler({"nvme": backend}, layout, to_file=True)
        load = DirectGPUFileHandler({"nvme": backend}, KVLayout(kv, kv.blocks_per_chunk), to_file=False)
        jobs = Jobs(store, load)
        made.append((jobs, backend))
        return backend, store, load, jobs
    yield make
    for jobs, backend in made:
        jobs.close()
        backend.close()


def test_direct_roundtrip_writes_aligned_payloads_with_torch_checksums(direct):
    from kvtier.tiers.file.checksum import bytes_checksum
    from kvtier.tiers.file.slot_format import CHECK_TORCH, HEADER_BYTES, parse_header

    kv = make_kv(bpc=2)
    backend, store, load, jobs = direct(kv)
    src = GPULoadStoreSpec([1, 2, 3, 4, 5, 6], group_sizes=[3, 3], block_indices=[1, 0])
    file_spec = FileLoadStoreSpec([7, 2, 11, 4], keys(4), tier="nvme")
    r = jobs.run(store, 1, src, file_spec)
    assert r.success, r.error
    data = backend.slab_path.read_bytes()
    for slot, key in zip([7, 2, 11, 4], keys(4)):
        base = slot * backend.slot_bytes
        header = parse_header(data[base:base + HEADER_BYTES])
        assert header.key == key and header.check_kind == CHECK_TORCH
        payload = data[base + HEADER_BYTES:base + HEADER_BYTES + backend.block_bytes]
        assert header.payload_crc == bytes_checksum(payload)
    assert sorted(backend.committed()) == [2, 4, 7, 11]
    # the host path reads what the direct path wrote (torch checksum verified on the host)
    out = bytearray(backend.block_bytes)
    backend.read_blocks([7], [keys(1)[0]], [out])
    before = [t.tensor.clone() for t in kv.tensors]
    for t in kv.tensors:
        t.tensor.zero_()
    dst = GPULoadStoreSpec([10, 11, 12, 13, 14, 15], group_sizes=[3, 3], block_indices=[1, 0])
    r = jobs.run(load, 2, file_spec, dst)
    assert r.success, r.error
    for t_idx, page in enumerate((4096, 2048)):
        assert torch.equal(kv.tensors[t_idx].tensor[10:16, :page], before[t_idx][1:7, :page])


def test_direct_load_of_host_written_blocks_checks_their_crc(direct):
    kv = make_kv()
    backend, store, load, jobs = direct(kv)
    blocks = [os.urandom(backend.block_bytes) for _ in range(2)]
    backend.write_blocks([3, 4], keys(2), blocks)  # the host path: CRC-32 slots
    r = jobs.run(load, 1, FileLoadStoreSpec([3, 4], keys(2), tier="nvme"), GPULoadStoreSpec([5, 6], group_sizes=[2, 0]))
    assert r.success, r.error
    assert kv.tensors[0].tensor[5, :4096].numpy().tobytes() == blocks[0][:4096]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_direct_load_of_a_corrupt_block_fails_alone(direct, where):
    from kvtier.tiers.file.slot_format import HEADER_BYTES

    kv = make_kv()
    backend, store, load, jobs = direct(kv)
    spec = FileLoadStoreSpec([0, 1], keys(2), tier="nvme")
    assert jobs.run(store, 1, GPULoadStoreSpec([1, 2], group_sizes=[2, 0]), spec).success
    offset = backend.slot_bytes + (HEADER_BYTES + 1234 if where == "payload" else 40)
    with open(backend.slab_path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    snapshot = [t.tensor.clone() for t in kv.tensors]
    bad = jobs.run(load, 2, spec, GPULoadStoreSpec([8, 9], group_sizes=[2, 0]))
    assert not bad.success and bad.failed_blocks == (1,) and "slot 1" in bad.error
    for t_idx, page in enumerate((4096, 2048)):  # the good block loaded, the bad one's page untouched
        assert torch.equal(kv.tensors[t_idx].tensor[8, :page], snapshot[t_idx][1, :page])
        assert torch.equal(kv.tensors[t_idx].tensor[9], snapshot[t_idx][9])
    assert sorted(backend.committed()) == [0]  # the bad block is forgotten, the good one kept


def test_direct_load_with_a_wrong_key_fails(direct):
    kv = make_kv()
    backend, store, load, jobs = direct(kv)
    assert jobs.run(store, 1, GPULoadStoreSpec([1], group_sizes=[1, 0]),
                    FileLoadStoreSpec([0], keys(1), tier="nvme")).success
    bad = jobs.run(load, 2, FileLoadStoreSpec([0], keys(1, start=9), tier="nvme"),
                   GPULoadStoreSpec([8], group_sizes=[1, 0]))
    assert not bad.success and "holds another key" in bad.error


def test_direct_path_chosen_only_for_cuda_with_kvikio():
    from kvtier.transfer.handlers.gpu_file import direct_path_available
    from kvtier.transfer.handlers.gpu_file_direct import DirectGPUFileHandler

    assert not direct_path_available(torch.device("cpu"))
    kv = make_kv()
    assert not isinstance(make_gpu_to_file({"x": FlakyBackend(KVLayout(kv, 1).block_bytes)}, kv),
                          DirectGPUFileHandler)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_direct_roundtrip(tmp_path):
    from kvtier.tiers.file.fileio import kvikio_importable
    from kvtier.transfer.handlers.gpu_file_direct import DirectGPUFileHandler

    if not kvikio_importable():
        pytest.skip("needs kvikio")
    kv = make_kv(device="cuda", bpc=2)
    layout = KVLayout(kv, kv.blocks_per_chunk)
    backend = FileBackend("nvme", 16, layout.block_bytes, root_dir=str(tmp_path / "nvme"), fingerprint="m",
                          io="kvikio")  # explicit: auto takes the direct path only with nvidia-fs
    store, load = make_gpu_to_file({"nvme": backend}, kv), make_file_to_gpu({"nvme": backend}, kv)
    assert isinstance(store, DirectGPUFileHandler) and isinstance(load, DirectGPUFileHandler)
    jobs = Jobs(store, load)
    try:
        spec = FileLoadStoreSpec([5, 6], keys(2), tier="nvme")
        src = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4, 0], block_indices=[0, 0])
        assert jobs.run(store, 1, src, spec).success
        before = [t.tensor.clone() for t in kv.tensors]
        r = jobs.run(load, 2, spec, GPULoadStoreSpec([9, 10, 11, 12], group_sizes=[4, 0], block_indices=[0, 0]))
        assert r.success, r.error
        for t_idx, page in enumerate((4096, 2048)):
            assert torch.equal(kv.tensors[t_idx].tensor[9:13, :page], before[t_idx][1:5, :page])
    finally:
        jobs.close()
        backend.close()


def test_direct_handlers_give_kvikio_threads_back(direct):
    import kvikio.defaults

    size = int(kvikio.defaults.get("num_threads"))
    kv = make_kv()
    backend, store, load, jobs = direct(kv)
    assert jobs.run(store, 1, GPULoadStoreSpec([1], group_sizes=[1, 0]),
                    FileLoadStoreSpec([0], keys(1), tier="nvme")).success
    assert int(kvikio.defaults.get("num_threads")) >= backend.num_threads
    jobs.close()
    assert int(kvikio.defaults.get("num_threads")) == size


def _flip_payload_byte(backend, slot: int) -> None:
    from kvtier.tiers.file.slot_format import HEADER_BYTES

    with open(backend.slab_path, "r+b") as f:
        f.seek(slot * backend.slot_bytes + HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(slot * backend.slot_bytes + HEADER_BYTES + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_split_load_reads_on_one_thread_and_scatters_on_another(setup, device):
    """vLLM's worker-side direct file load (`FileLoads`): `stage_load` on a pool thread reads and
    verifies, `finish_load` on the engine's thread scatters; a block whose payload changed on disk
    is named by the read half and not scattered (its engine blocks untouched), the others are."""
    from concurrent.futures import ThreadPoolExecutor

    kv = make_kv(device=device, bpc=2)
    layout, backend, store, load, jobs = setup(kv)
    spec = FileLoadStoreSpec([5, 6, 9], keys(3), tier="nvme")
    assert jobs.run(store, 1, GPULoadStoreSpec([1, 2, 3, 4, 5, 6], group_sizes=[6, 0], block_indices=[0, 0]),
                    spec).success
    before = [t.tensor.clone() for t in kv.tensors]
    dst = GPULoadStoreSpec([9, 10, 11, 12, 13, 14], group_sizes=[6, 0], block_indices=[0, 0])
    with ThreadPoolExecutor(1) as pool:
        staged = pool.submit(load.stage_load, spec, dst).result()
        assert load.finish_load(*staged) == 6 * (4096 + 2048)
        for t_idx, page in enumerate((4096, 2048)):
            assert torch.equal(kv.tensors[t_idx].tensor[9:15, :page], before[t_idx][1:7, :page])

        _flip_payload_byte(backend, 6)
        for t in kv.tensors:
            t.tensor[9:15] = 0
        staged = pool.submit(load.stage_load, spec, dst).result()
        assert staged[3].positions == (1,)  # the second block failed verification
        with pytest.raises(BlocksFailed) as failed:
            load.finish_load(*staged)
        assert failed.value.positions == (1,)
        for t_idx, page in enumerate((4096, 2048)):  # blocks 0 and 2 (engine 9-10, 13-14) loaded, 1 untouched
            t = kv.tensors[t_idx].tensor
            assert torch.equal(t[[9, 10, 13, 14], :page], before[t_idx][[1, 2, 5, 6], :page])
            assert int(t[11:13].abs().sum()) == 0
