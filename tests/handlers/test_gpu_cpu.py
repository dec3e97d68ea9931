"""Engine KV cache <-> CPU tier handlers: byte-exact round trips against a per-block reference."""

from __future__ import annotations

import math
import threading

import pytest
from conftest import Jobs
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    build_hierarchy,
    load_config_text,
)
from kvtier.tiers.base import HostRegion, HostSlots
from kvtier.tiers.cpu import CPUBackend
from kvtier.tiers.memory import MemoryBackend
from kvtier.transfer.handlers import rows
from kvtier.transfer.handlers.gpu_cpu import ChunkedKVCaches, KVLayout, make_cpu_to_gpu, make_gpu_to_cpu, make_handler

torch = pytest.importorskip("torch")

NUM_ENGINE_BLOCKS = 24


def make_kv(device="cpu", pages=(256, 512), pads=(64, 0), groups=((0, 1), (1, 0)), seed=0, dtype=None):
    """Tensors of `page + pad` bytes per row (stride(0) > page when pad > 0); group refs by tensor index."""
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for page, pad in zip(pages, pads):
        t = torch.randint(-128, 128, (NUM_ENGINE_BLOCKS, page + pad), dtype=torch.int8, generator=g).to(device)
        if dtype is not None:
            t = t.view(dtype)
        tensors.append(CanonicalKVCacheTensor(t, page))
    refs = [[CanonicalKVCacheRef(i, pages[i]) for i in grp] for grp in groups]
    return CanonicalKVCaches(tensors, refs)


def engine_page(kv, t_idx, block, page):
    return kv.tensors[t_idx].tensor.view(torch.int8)[block].cpu().numpy().tobytes()[:page]


def expected_slot_bytes(layout, kv, spec, slots):
    """Per-block reference: {(slot, byte offset): page bytes} the store must produce."""
    out = {}
    first, pos = 0, 0
    skips = spec.block_indices or [0] * len(spec.group_sizes)
    for g, (n, logical) in enumerate(zip(spec.group_sizes, skips)):
        if n == 0:
            continue
        skip = logical % layout.blocks_per_chunk
        for p in range(n):
            slot = slots[pos + (skip + p) // layout.blocks_per_chunk]
            j = (skip + p) % layout.blocks_per_chunk
            for seg in layout.groups[g]:
                out[(slot, seg.offset + j * seg.page)] = engine_page(kv, seg.tensor_idx, spec.block_ids[first + p],
                                                                     seg.page)
        first += n
        pos += math.ceil((n + skip) / layout.blocks_per_chunk)
    return out


@pytest.fixture
def tier():
    made = []

    def make(kv, bpc, num=16):
        layout = KVLayout(kv, bpc)
        b = CPUBackend("cpu", num, layout.block_bytes, pin="false")
        made.append(b)
        return layout, b
    yield make
    for b in made:
        b.close()


@pytest.fixture(params=["whole", "in_parts"])
def row_copies(request, monkeypatch):
    """Host row copies as one call each, or (`in_parts`) every one cut into a part per torch
    thread (3 threads), the path large copies take."""
    if request.param == "whole":
        yield request.param
        return
    monkeypatch.setattr(rows, "PARALLEL_COPY_BYTES", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield request.param
    torch.set_num_threads(threads)


def test_host_row_copies_in_parts_equal_one_copy():
    copier = rows.RowCopier(parallel_bytes=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        g = torch.Generator().manual_seed(1)
        src = torch.randint(-2**62, 2**62, (10, 7), dtype=torch.int64, generator=g)
        index = torch.randperm(10, generator=g)
        out = torch.zeros_like(src)
        copier.index_select(src, index, out)
        assert torch.equal(out, src[index])
        dst, expected = torch.zeros_like(src), torch.zeros_like(src)
        copier.index_copy(dst, index, src)
        expected[index] = src
        assert torch.equal(dst, expected)
        dst = torch.zeros_like(src)  # repeated rows: one copy in numpy's order, the last one wins
        copier.index_copy(dst, torch.tensor([3, 3, 1, 3]), src[:4])
        assert torch.equal(dst[3], src[3]) and torch.equal(dst[1], src[2]) and int(dst[0].abs().sum()) == 0
        wide = torch.zeros((10, 9), dtype=torch.int64)  # a strided destination: torch's own path
        copier.index_select(src, index, wide[:, 1:8])
        assert torch.equal(wide[:, 1:8], src[index]) and int(wide[:, 0].abs().sum() + wide[:, 8].abs().sum()) == 0
        for bad in (torch.tensor([0, 10]), torch.tensor([-1, 2])):  # never clipped into a wrong row
            with pytest.raises(IndexError):
                copier.index_select(src, bad, torch.zeros((2, 7), dtype=torch.int64))
    finally:
        copier.close()
        torch.set_num_threads(threads)


def roundtrip(kv, layout, backend, store_spec, slots, load_spec):
    """Store `store_spec` into `slots`, check every byte, wipe the engine, load into `load_spec`."""
    chunked = ChunkedKVCaches(kv.tensors, kv.group_data_refs, layout.blocks_per_chunk)
    store = make_gpu_to_cpu({"cpu": backend}, chunked)
    load = make_cpu_to_gpu({"cpu": backend}, chunked)
    jobs = Jobs(store, load)
    r = jobs.run(store, 1, store_spec, CPULoadStoreSpec(slots, tier="cpu"))
    assert r.success, r.error
    assert r.transfer_size == layout.bytes_of(store_spec)
    for (slot, off), page in expected_slot_bytes(layout, kv, store_spec, slots).items():
        assert bytes(backend.view(slot)[off:off + len(page)]) == page, (slot, off)
    before = [t.tensor.clone() for t in kv.tensors]
    for t in kv.tensors:
        t.tensor.zero_()
    r = jobs.run(load, 2, CPULoadStoreSpec(slots, tier="cpu"), load_spec)
    assert r.success, r.error
    return before


def test_several_groups_stride_padding_and_partial_first_block(tier, row_copies):
    kv = make_kv()
    layout, backend = tier(kv, 2)
    assert layout.block_bytes == 2 * (256 + 512) and layout.group_bytes == [1536, 1536]
    # group 0: 5 blocks starting at logical index 1 (skip 1 sub-block) -> 3 slots; group 1: 2 blocks -> 1 slot
    store = GPULoadStoreSpec([1, 2, 3, 4, 5, 6, 7], group_sizes=[5, 2], block_indices=[1, 0])
    load = GPULoadStoreSpec([11, 12, 13, 14, 15, 16, 17], group_sizes=[5, 2], block_indices=[1, 0])
    before = roundtrip(kv, layout, backend, store, [3, 0, 9, 6], load)
    for t_idx, (t, page) in enumerate(zip(kv.tensors, (256, 512))):
        for a, b in zip(store.block_ids, load.block_ids):
            assert torch.equal(t.tensor[b, :page], before[t_idx][a, :page])
        assert int(t.tensor[:, page:].abs().sum()) == 0  # padding past the page never written
        assert int(t.tensor[:11].abs().sum()) == 0  # blocks outside the spec untouched


def test_unaligned_reference_offsets_use_the_general_path(tier, row_copies):
    # pages 256 and 384: the second reference starts at 512, not a multiple of 384
    kv = make_kv(pages=(256, 384), pads=(0, 128), groups=((0, 1),))
    layout, backend = tier(kv, 2)
    spec = GPULoadStoreSpec([9, 4, 7], block_indices=[3])
    before = roundtrip(kv, layout, backend, spec, [5, 2], GPULoadStoreSpec([0, 1, 2], block_indices=[3]))
    for t_idx, page in enumerate((256, 384)):
        assert torch.equal(kv.tensors[t_idx].tensor[:3, :page], before[t_idx][[9, 4, 7], :page])


def test_non_byte_dtype_and_one_group_default(tier, row_copies):
    kv = make_kv(pages=(1024,), pads=(0,), groups=(), dtype=torch.float16)
    layout, backend = tier(kv, 1)
    spec = GPULoadStoreSpec([5, 3, 8])
    before = roundtrip(kv, layout, backend, spec, [7, 8, 1], GPULoadStoreSpec([0, 1, 2]))
    assert torch.equal(kv.tensors[0].tensor[:3].view(torch.int8), before[0][[5, 3, 8]].view(torch.int8))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_geometries_match_the_reference(data):
    bpc = data.draw(st.integers(1, 3), label="bpc")
    num_groups = data.draw(st.integers(1, 3), label="groups")
    sizes = data.draw(st.lists(st.integers(0, 5), min_size=num_groups, max_size=num_groups), label="sizes")
    starts = data.draw(st.lists(st.integers(0, 7), min_size=num_groups, max_size=num_groups), label="starts")
    total = sum(sizes)
    engine_ids = data.draw(st.permutations(range(NUM_ENGINE_BLOCKS)), label="ids")[:total]
    kv = make_kv(pages=(64, 128, 192), pads=(0, 64, 8), groups=[(0, 2), (1,), (2, 0, 1)][:num_groups],
                 seed=data.draw(st.integers(0, 5)))
    layout = KVLayout(kv, bpc)
    spec = GPULoadStoreSpec(engine_ids, group_sizes=sizes, block_indices=starts)
    n_slots = layout.slots_needed(spec)
    slots = data.draw(st.permutations(range(16)), label="slots")[:n_slots]
    backend = CPUBackend("cpu", 16, layout.block_bytes, pin="false")
    try:
        targets = data.draw(st.permutations(range(NUM_ENGINE_BLOCKS)), label="targets")[:total]
        before = roundtrip(kv, layout, backend, spec, slots,
                           GPULoadStoreSpec(targets, group_sizes=sizes, block_indices=starts))
        first = 0
        for g, n in enumerate(sizes):
            for a, b in zip(engine_ids[first:first + n], targets[first:first + n]):
                for seg in layout.groups[g]:
                    t = seg.tensor_idx
                    assert torch.equal(kv.tensors[t].tensor[b, :seg.page], before[t][a, :seg.page])
            first += n
    finally:
        backend.close()


def test_a_failing_job_fails_only_itself(tier):
    kv = make_kv()
    layout, backend = tier(kv, 1)
    store = make_gpu_to_cpu({"cpu": backend}, kv)
    jobs = Jobs(store)
    bad = jobs.run(store, 1, GPULoadStoreSpec([1, 2], group_sizes=[2, 0]), CPULoadStoreSpec([0], tier="cpu"))
    assert not bad.success and "slots" in bad.error
    oob = jobs.run(store, 2, GPULoadStoreSpec([99], group_sizes=[1, 0]), CPULoadStoreSpec([0], tier="cpu"))
    assert not oob.success
    good = jobs.run(store, 3, GPULoadStoreSpec([1, 2], group_sizes=[1, 1]), CPULoadStoreSpec([0, 1], tier="cpu"))
    assert good.success and good.transfer_size == 2 * layout.block_bytes


def test_factories_need_kv_caches_and_a_host_tier():
    kv = make_kv()
    mem = MemoryBackend("mem", 4, KVLayout(kv, 1).block_bytes)
    assert make_gpu_to_cpu({"mem": mem}, None) is None
    assert make_handler({}, kv, to_cpu=True) is None
    store = make_gpu_to_cpu({"mem": mem}, kv)  # a memory tier's arena serves as the region
    jobs = Jobs(store)
    assert jobs.run(store, 1, GPULoadStoreSpec([3], group_sizes=[0, 1]), CPULoadStoreSpec([2], tier="mem")).success
    assert bytes(mem.view(2)[:512]) == engine_page(kv, 1, 3, 512)


def test_built_hierarchy_routes_engine_hops(tmp_path):
    kv = make_kv()
    layout = KVLayout(kv, 1)
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks, pin: false}\n")
    with build_hierarchy(cfg, block_bytes=layout.block_bytes, kv_caches=kv) as h:
        assert h.worker.handler_for(GPULoadStoreSpec, CPULoadStoreSpec) is not None
        assert h.worker.handler_for(CPULoadStoreSpec, GPULoadStoreSpec) is not None
        assert h.router.handler_for(GPULoadStoreSpec, CPULoadStoreSpec) is None  # not the manager's jobs
        job = h.worker.submit(GPULoadStoreSpec([3], group_sizes=[1, 0]), CPULoadStoreSpec([5], tier="cpu"))
        (result,) = h.worker.poll()
        assert result.job_id == job and result.success
        assert bytes(h.backends["cpu"].view(5)[:256]) == engine_page(kv, 0, 3, 256)


# ------------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slots", [[4, 5, 6, 7], [9, 2, 13, 0]], ids=["consecutive", "scattered"])
def test_cuda_roundtrip(tier, slots):
    kv = make_kv(device="cuda")
    layout, backend = tier(kv, 2)
    store = GPULoadStoreSpec([1, 2, 3, 4, 5, 6, 7], group_sizes=[5, 2], block_indices=[1, 0])
    load = GPULoadStoreSpec([11, 12, 13, 14, 15, 16, 17], group_sizes=[5, 2], block_indices=[1, 0])
    before = roundtrip(kv, layout, backend, store, slots, load)
    for t_idx, page in enumerate((256, 512)):
        assert torch.equal(kv.tensors[t_idx].tensor[11:18, :page], before[t_idx][1:8, :page])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_waits_for_the_compute_stream(tier):
    kv = make_kv(device="cuda", pages=(1 << 20,), pads=(0,), groups=((0,),))
    layout, backend = tier(kv, 1)
    handler = make_gpu_to_cpu({"cpu": backend}, kv)
    jobs = Jobs(handler)
    t = kv.tensors[0].tensor
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy before the write below
    big @ big
    t[3].fill_(7)  # the "model" writes block 3 on the compute stream
    r = jobs.run(handler, 1, GPULoadStoreSpec([3]), CPULoadStoreSpec([0], tier="cpu"))
    assert r.success
    assert set(bytes(backend.view(0))) == {7}


@pytest.fixture
def fake_cuda_api(monkeypatch):
    """Streams, events and pinned allocation as no-ops on the host (`tests.support.fake_cuda`), so
    that the CUDA handler's own logic (staging, bounce buffer, consecutive-slot DMA, word views)
    runs without a GPU. It says nothing about real stream ordering: that is what the `gpu` tests are for."""
    from tests.support.fake_cuda import host_cuda_patches

    for patch in host_cuda_patches(torch):
        monkeypatch.setattr(*patch)


@pytest.mark.parametrize("fast", [False, True], ids=["staged", "fast-path"])
@pytest.mark.parametrize("slots", [[4, 5, 6, 7], [9, 2, 13, 0]], ids=["consecutive", "scattered"])
def test_cuda_handler_logic_on_host_tensors(fake_cuda_api, monkeypatch, tier, slots, fast):
    """`fast`: a pinned region and a self-checked fast path (a `HostDMA`): a job is one plan of
    page <-> slot-place copies, whatever the slot order."""
    from kvtier.transfer.handlers import fast_path
    from kvtier.transfer.handlers.gpu_cpu import CudaKVCopyHandler

    kv = make_kv()
    layout, backend = tier(kv, 2)
    dma = HostDMA()
    if fast:
        monkeypatch.setattr(fast_path, "cuda_fast_path", lambda device, pages=None: dma)
        backend.pinned = True
    store_h = CudaKVCopyHandler({"cpu": backend}, layout, True)
    load_h = CudaKVCopyHandler({"cpu": backend}, layout, False)
    jobs = Jobs(store_h, load_h)
    store = GPULoadStoreSpec([1, 2, 3, 4, 5, 6, 7], group_sizes=[5, 2], block_indices=[1, 0])
    assert jobs.run(store_h, 1, store, CPULoadStoreSpec(slots, tier="cpu")).success
    for (slot, off), page in expected_slot_bytes(layout, kv, store, slots).items():
        assert bytes(backend.view(slot)[off:off + len(page)]) == page
    before = [t.tensor.clone() for t in kv.tensors]
    for t in kv.tensors:
        t.tensor.zero_()
    load = GPULoadStoreSpec([11, 12, 13, 14, 15, 16, 17], group_sizes=[5, 2], block_indices=[1, 0])
    assert jobs.run(load_h, 2, CPULoadStoreSpec(slots, tier="cpu"), load).success
    for t_idx, page in enumerate((256, 512)):
        assert torch.equal(kv.tensors[t_idx].tensor[11:18, :page], before[t_idx][1:8, :page])
    bad = jobs.run(store_h, 3, store, CPULoadStoreSpec([1], tier="cpu"))
    assert not bad.success
    assert [p.nbytes for p in dma.plans] == ([layout.bytes_of(store)] * 2 if fast else [])
    store_h.shutdown()
    load_h.shutdown()


class HostDMA:
    """A fast path that executes each plan with memmove (what a correct CUDA submitter does)."""

    name = "host memmove"

    def __init__(self):
        self.plans = []

    def submit(self, plan, stream) -> None:
        import ctypes

        self.plans.append(plan)
        for src, dst, size in zip(plan.src.tolist(), plan.dst.tolist(), plan.size.tolist()):
            ctypes.memmove(dst, src, size)


@pytest.fixture
def host_dma(monkeypatch):
    """The CUDA handler's fast path, self-checked: a `HostDMA` (on host tensors, with `fake_cuda_api`)."""
    from kvtier.transfer.handlers import fast_path

    dma = HostDMA()
    monkeypatch.setattr(fast_path, "cuda_fast_path", lambda device, pages=None: dma)
    return dma


def test_a_job_that_fails_in_the_fast_path_is_redone_on_the_staged_path(fake_cuda_api, monkeypatch, tier):
    """A fast path that fails a job (a CUDA error after its self-check passed) is dropped: the job
    still succeeds, byte-exact, through the staged path, and so do the next ones."""
    from kvtier.transfer.handlers import fast_path
    from kvtier.transfer.handlers.cuda_copy import CopyError
    from kvtier.transfer.handlers.gpu_cpu import CudaKVCopyHandler

    class Failing(HostDMA):
        def submit(self, plan, stream) -> None:
            self.plans.append(plan)
            raise CopyError("cudaMemcpyBatchAsync of 3 descriptors returned error 700")

    failing, demoted = Failing(), []
    monkeypatch.setattr(fast_path, "cuda_fast_path", lambda device, pages=None: failing)
    monkeypatch.setattr(fast_path, "demote_cuda", lambda device, submitter, why: demoted.append((submitter, why)))
    kv = make_kv()
    layout, backend = tier(kv, 1)
    backend.pinned = True
    handler = CudaKVCopyHandler({"cpu": backend}, layout, True)
    jobs = Jobs(handler)
    try:
        for job_id, (ids, slots) in enumerate((([1, 2], [5, 3]), ([4], [7]))):
            spec = GPULoadStoreSpec(ids, group_sizes=[len(ids), 0])
            assert jobs.run(handler, job_id, spec, CPULoadStoreSpec(slots, tier="cpu")).success
            for (slot, off), page in expected_slot_bytes(layout, kv, spec, slots).items():
                assert bytes(backend.view(slot)[off:off + len(page)]) == page
        assert len(failing.plans) == 1 and demoted == [(failing, "cudaMemcpyBatchAsync of 3 descriptors "
                                                                 "returned error 700")]
    finally:
        jobs.close()


def test_the_fast_path_plans_and_submits_on_the_callers_thread(fake_cuda_api, monkeypatch, tier):
    """A fast-path job is planned and submitted inside `submit`, on the caller's thread (job
    threads that each planned convoyed on the GIL: 44-52 % of the link at 64 KiB on an H200);
    a completion thread reports the jobs, in submission order, once their end events fired."""
    import threading

    from kvtier.transfer.handlers import fast_path
    from kvtier.transfer.handlers.gpu_cpu import CudaKVCopyHandler

    class Recording(HostDMA):
        def submit(self, plan, stream) -> None:
            threads.append(threading.get_ident())
            super().submit(plan, stream)

    threads: list[int] = []
    dma = Recording()
    monkeypatch.setattr(fast_path, "cuda_fast_path", lambda device, pages=None: dma)
    kv = make_kv()
    layout, backend = tier(kv, 1)
    backend.pinned = True
    handler = CudaKVCopyHandler({"cpu": backend}, layout, True)
    order: list[int] = []
    handler.bind(lambda result: order.append(result.job_id) if result.success else None)
    try:
        for job_id in range(6):
            handler.submit(job_id, GPULoadStoreSpec([job_id + 1], group_sizes=[1, 0]),
                           CPULoadStoreSpec([15 - job_id], tier="cpu"))
            assert len(dma.plans) == job_id + 1  # submitted before `submit` returned
        handler.wait(range(6))
        assert threads == [threading.get_ident()] * 6
        assert order == list(range(6))
        for job_id in range(6):
            spec = GPULoadStoreSpec([job_id + 1], group_sizes=[1, 0])
            for (slot, off), page in expected_slot_bytes(layout, kv, spec, [15 - job_id]).items():
                assert bytes(backend.view(slot)[off:off + len(page)]) == page
    finally:
        handler.shutdown()


def test_an_error_at_a_jobs_end_event_fails_that_job_only(fake_cuda_api, monkeypatch, tier, host_dma):
    """An asynchronous copy error (raised when the job's end event is waited for) fails that job;
    the next jobs are reported as usual, and `wait` returns for all of them."""
    import torch as real_torch

    from kvtier.transfer.handlers.gpu_cpu import CudaKVCopyHandler

    created: list = []

    class Event:
        """Events in creation order: on host tensors a job makes one, its end event (no compute
        stream to wait for), so event 1 is job 1's end."""

        def __init__(self):
            self.index = len(created)
            created.append(self)

        def record(self, stream=None):
            pass

        def synchronize(self):
            if self.index == 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    kv = make_kv()
    layout, backend = tier(kv, 1)
    backend.pinned = True
    handler = CudaKVCopyHandler({"cpu": backend}, layout, False)
    monkeypatch.setattr(real_torch.cuda, "Event", Event)
    jobs = Jobs(handler)
    try:
        outcomes = [jobs.run(handler, j, CPULoadStoreSpec([j], tier="cpu"),
                             GPULoadStoreSpec([j + 1], group_sizes=[1, 0])) for j in range(3)]
        assert [r.success for r in outcomes] == [True, False, True]
        assert "illegal memory access" in outcomes[1].error and outcomes[1].transfer_size == 0
        assert len(created) == 3
    finally:
        jobs.close()


def test_a_load_never_waits_for_a_store_on_the_other_stream(fake_cuda_api, monkeypatch, tier, host_dma):
    """Stores and loads have their own streams and completion threads: while a store's copies are
    still running on its stream (its end event not fired), a load submitted after it is planned,
    submitted on the load stream and reported; the store is reported once its stream gets there."""
    import torch as real_torch

    from kvtier.transfer.handlers.gpu_cpu import CudaKVCopyHandler

    kv = make_kv()
    layout, backend = tier(kv, 1)
    backend.pinned = True
    store_h = CudaKVCopyHandler({"cpu": backend}, layout, True)
    load_h = CudaKVCopyHandler({"cpu": backend}, KVLayout(kv, 1), False)
    assert store_h.stream is not load_h.stream
    store_stream_done, recorded = threading.Event(), []

    class Event:
        def record(self, stream=None):
            self.stream = stream
            recorded.append(stream)

        def synchronize(self):
            if self.stream is store_h.stream:  # the store stream's copies end when the test says so
                assert store_stream_done.wait(10)

    monkeypatch.setattr(real_torch.cuda, "Event", Event)
    reported: list[tuple[str, bool]] = []
    store_h.bind(lambda r: reported.append(("store", r.success)))
    load_h.bind(lambda r: reported.append(("load", r.success)))
    try:
        store_h.submit(1, GPULoadStoreSpec([1, 2], group_sizes=[2, 0]), CPULoadStoreSpec([3, 4], tier="cpu"))
        load_h.submit(2, CPULoadStoreSpec([5], tier="cpu"), GPULoadStoreSpec([7], group_sizes=[1, 0]))
        load_h.wait([2])
        assert reported == [("load", True)]  # the store is still running on its own stream
        assert recorded == [store_h.stream, load_h.stream]  # each job's end on its own stream
        store_stream_done.set()
        store_h.wait([1])
        assert reported == [("load", True), ("store", True)] and len(host_dma.plans) == 2
    finally:
        store_stream_done.set()
        store_h.shutdown()
        load_h.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stores_and_loads_at_once_are_byte_exact():
    """Blocks 0-7 stored while blocks 8-15 are loaded from the slots they were stored in, jobs of
    both handlers submitted alternately: each direction on its own stream, every byte right."""
    kv = make_kv(device="cuda", pages=(65536,), pads=(0,), groups=((0,),))
    layout = KVLayout(kv, 1)
    backend = CPUBackend("cpu", 16, layout.block_bytes, pin="true")
    store, load = make_gpu_to_cpu({"cpu": backend}, kv), make_cpu_to_gpu({"cpu": backend}, kv)
    jobs = Jobs(store, load)
    try:
        engine = kv.tensors[0].tensor
        original = engine.clone()
        slots = [9, 2, 13, 0, 7, 4, 15, 11, 1, 8, 3, 14, 6, 12, 5, 10]
        assert jobs.run(store, 0, GPULoadStoreSpec(range(16)), CPULoadStoreSpec(slots, tier="cpu")).success
        engine[8:].zero_()
        results: list = []
        store.bind(results.append)
        load.bind(results.append)
        for j in range(4):
            store.submit(10 + j, GPULoadStoreSpec([2 * j, 2 * j + 1]), CPULoadStoreSpec(slots[2 * j:2 * j + 2],
                                                                                           tier="cpu"))
            load.submit(20 + j, CPULoadStoreSpec(slots[8 + 2 * j:10 + 2 * j], tier="cpu"),
                        GPULoadStoreSpec([8 + 2 * j, 9 + 2 * j]))
        store.wait(range(10, 14))
        load.wait(range(20, 24))
        assert sorted(r.job_id for r in results if r.success) == [10, 11, 12, 13, 20, 21, 22, 23]
        torch.cuda.synchronize()
        assert torch.equal(engine, original)
        for i, slot in enumerate(slots[:8]):
            assert bytes(backend.view(slot)[:65536]) == engine_page(kv, 0, i, 65536)
    finally:
        jobs.close()
        backend.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["batch", "bindings", "loop", "staged"])
def test_cuda_roundtrip_through_each_copy_path(monkeypatch, mode):
    from kvtier.transfer.handlers import fast_path

    monkeypatch.setenv("KVTIER_GPU_COPY", mode)
    fast_path.CHOICE.forget()
    kv = make_kv(device="cuda")
    layout = KVLayout(kv, 2)
    backend = CPUBackend("cpu", 16, layout.block_bytes, pin="true")
    try:
        store = GPULoadStoreSpec([1, 2, 3, 4, 5, 6, 7], group_sizes=[5, 2], block_indices=[1, 0])
        load = GPULoadStoreSpec([11, 12, 13, 14, 15, 16, 17], group_sizes=[5, 2], block_indices=[1, 0])
        before = roundtrip(kv, layout, backend, store, [9, 2, 13, 0], load)
        for t_idx, page in enumerate((256, 512)):
            assert torch.equal(kv.tensors[t_idx].tensor[11:18, :page], before[t_idx][1:8, :page])
        chosen = fast_path.cuda_fast_path(kv.tensors[0].tensor.device)
        assert (chosen is None) == (mode == "staged")
    finally:
        backend.close()
        fast_path.CHOICE.forget()


class ViewOnly:
    """A host-memory backend offering `view` alone (a `HostSlots`, not a `HostRegion`)."""

    def __init__(self, backend):
        self.name, self.num_blocks, self.block_bytes = backend.name, backend.num_blocks, backend.block_bytes
        self.view = backend.view


def test_engine_handlers_serve_the_backends_that_declare_a_host_region(tier):
    kv = make_kv()
    layout, cpu = tier(kv, 1)
    mem = MemoryBackend("mem", 4, layout.block_bytes)
    assert isinstance(cpu, HostRegion) and isinstance(mem, HostRegion)
    view_only = ViewOnly(mem)
    assert isinstance(view_only, HostSlots) and not isinstance(view_only, HostRegion)
    assert make_gpu_to_cpu({"v": view_only}, kv) is None  # cannot be addressed as one region
    store = make_gpu_to_cpu({"cpu": cpu, "v": view_only, "mem": mem}, kv)
    assert sorted(store.backends) == ["cpu", "mem"]
    jobs = Jobs(store)
    for tier_name, backend in (("cpu", cpu), ("mem", mem)):
        spec = GPULoadStoreSpec([4], group_sizes=[0, 1])
        assert jobs.run(store, id(backend), spec, CPULoadStoreSpec([1], tier=tier_name)).success
        assert bytes(backend.view(1)[:512]) == engine_page(kv, 1, 4, 512)
    jobs.close()


def _row_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("kvtier-rows")}


def test_shutting_a_handler_down_stops_its_row_copy_threads():
    """A copy large enough to run in parts starts copy threads; they belong to the handler and end
    with its shutdown (they were process-wide and never shut down)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        page = 1 << 20
        kv = make_kv(pages=(page, page), pads=(0, 0))
        layout = KVLayout(kv, 1)
        mem = MemoryBackend("mem", 8, layout.block_bytes)
        before = _row_threads()
        store = make_gpu_to_cpu({"mem": mem}, kv)
        load = make_cpu_to_gpu({"mem": mem}, kv)
        jobs = Jobs(store, load)
        spec = GPULoadStoreSpec(list(range(8)), group_sizes=[4, 4])
        assert jobs.run(store, 1, spec, CPULoadStoreSpec(list(range(8)), tier="mem")).success
        assert jobs.run(load, 2, CPULoadStoreSpec(list(range(8)), tier="mem"), spec).success
        started = _row_threads() - before
        assert started, "an 8 MiB host copy should have run in parts"
        jobs.close()
        assert not any(t.is_alive() for t in started)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ per-rank byte ranges of a slot


def _rank_handlers(kind, kv, backend, bpc, offset, length):
    """Store and load handlers of one rank that owns bytes [offset, offset + length) of each slot."""
    from kvtier.transfer.handlers.gpu_cpu import CudaKVCopyHandler

    if kind == "host":
        chunked = ChunkedKVCaches(kv.tensors, kv.group_data_refs, bpc, offset, length)
        return make_gpu_to_cpu({"cpu": backend}, chunked), make_cpu_to_gpu({"cpu": backend}, chunked)
    return tuple(CudaKVCopyHandler({"cpu": backend}, KVLayout(kv, bpc, offset, length), to_cpu)
                 for to_cpu in (True, False))


def _ranks_share_slots(kind, pages, pads, groups, device="cpu", pinned=False):
    """Two ranks (different KV bytes) store the same engine blocks into the same slots, each into
    its own half of every slot; each loads its half back into fresh blocks, byte-exact. `pinned`:
    the region counts as pinned (the CUDA handler's fast path)."""
    bpc = 2
    sizes, skips, slots = ([5, 2], [1, 0], [9, 2, 13, 0]) if len(groups) == 2 else ([7], [1], [9, 2, 13, 0])
    kvs = [make_kv(device, pages=pages, pads=pads, groups=groups, seed=rank + 1) for rank in (0, 1)]
    part = KVLayout(kvs[0], bpc).block_bytes
    backend = CPUBackend("cpu", 16, 2 * part, pin="true" if pinned and device == "cuda" else "false")
    backend.pinned = backend.pinned or pinned
    handlers = [_rank_handlers(kind, kv, backend, bpc, rank * part, part) for rank, kv in enumerate(kvs)]
    jobs = Jobs(*[h for pair in handlers for h in pair])
    store = GPULoadStoreSpec([1, 2, 3, 4, 5, 6, 7], group_sizes=sizes, block_indices=skips)
    load = GPULoadStoreSpec([11, 12, 13, 14, 15, 16, 17], group_sizes=sizes, block_indices=skips)
    try:
        for rank in (1, 0):  # rank 0 second: a whole-slot copy would overwrite rank 1's half
            assert jobs.run(handlers[rank][0], 10 + rank, store, CPULoadStoreSpec(slots, tier="cpu")).success
        for rank, kv in enumerate(kvs):
            layout = KVLayout(kv, bpc)
            for (slot, off), page in expected_slot_bytes(layout, kv, store, slots).items():
                at = rank * part + off
                assert bytes(backend.view(slot)[at:at + len(page)]) == page, (rank, slot, off)
        before = [[t.tensor.clone() for t in kv.tensors] for kv in kvs]
        for rank, kv in enumerate(kvs):
            assert jobs.run(handlers[rank][1], 20 + rank, CPULoadStoreSpec(slots, tier="cpu"), load).success
            for t_idx, page in enumerate(pages):
                for a, b in zip(store.block_ids, load.block_ids):
                    assert torch.equal(kv.tensors[t_idx].tensor[b, :page], before[rank][t_idx][a, :page]), rank
    finally:
        for pair in handlers:
            for h in pair:
                h.shutdown()
        backend.close()


@pytest.mark.parametrize("geometry", [((256, 512), (64, 0), ((0, 1), (1, 0))), ((256, 384), (0, 128), ((0, 1),))],
                         ids=["aligned", "unaligned"])
def test_ranks_copy_only_their_byte_range_of_a_slot(geometry, row_copies):
    _ranks_share_slots("host", *geometry)


def test_cuda_handler_copies_only_its_byte_range_on_host_tensors(fake_cuda_api):
    _ranks_share_slots("cuda", (256, 512), (64, 0), ((0, 1), (1, 0)))


def test_the_fast_path_copies_only_a_ranks_byte_range_on_host_tensors(fake_cuda_api, host_dma):
    _ranks_share_slots("cuda", (256, 512), (64, 0), ((0, 1), (1, 0)), pinned=True)
    assert len(host_dma.plans) == 4  # two ranks, a store and a load each


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pinned", [False, True], ids=["staged", "fast-path"])
def test_cuda_ranks_copy_only_their_byte_range_of_a_slot(pinned):
    _ranks_share_slots("cuda", (256, 512), (64, 0), ((0, 1), (1, 0)), device="cuda", pinned=pinned)


def test_a_slot_range_smaller_than_the_pages_or_past_the_slot_is_refused():
    kv = make_kv()
    part = KVLayout(kv, 1).block_bytes
    with pytest.raises(ValueError, match="slot_length"):
        KVLayout(kv, 1, 0, part - 1)
    backend = CPUBackend("cpu", 4, part, pin="false")
    try:
        store = make_gpu_to_cpu({"cpu": backend}, ChunkedKVCaches(kv.tensors, kv.group_data_refs, 1, part, part))
        r = Jobs(store).run(store, 1, GPULoadStoreSpec([1], group_sizes=[1, 0]), CPULoadStoreSpec([0], tier="cpu"))
        assert not r.success and "bytes" in str(r.error)
        store.shutdown()
    finally:
        backend.close()
