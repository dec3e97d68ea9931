"""The copy plan (page <-> slot-place descriptors) executed by a host memmove, against `KVLayout`'s
gather/scatter (what `HostKVCopyHandler` does), over random layouts; and its coalescing."""

from __future__ import annotations

import ctypes
import math
import random

import numpy as np
import pytest

from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from kvtier.transfer.handlers.copy_plan import CopyPlan, coalesce, plan_copies
from kvtier.transfer.handlers.kv_layout import KVLayout

torch = pytest.importorskip("torch")

ENGINE_BLOCKS = 40
SLOTS = 24


def execute(plan: CopyPlan) -> None:
    """The reference executor: one memmove per descriptor."""
    for src, dst, size in zip(plan.src.tolist(), plan.dst.tolist(), plan.size.tolist()):
        ctypes.memmove(dst, src, size)


def random_layout(rng: random.Random):
    """(tensors, refs, bpc, slot_offset, slot_length): 1-3 tensors with padded rows, 1-3 groups of
    references with pages up to their tensor's, possibly a TP byte range of each slot."""
    pages = [rng.choice([8, 24, 64, 256, 1000]) for _ in range(rng.randint(1, 3))]
    tensors = [torch.randint(-128, 128, (ENGINE_BLOCKS, p + rng.choice([0, 0, 8, 40])), dtype=torch.int8)
               for p in pages]
    refs = []
    for _ in range(rng.randint(1, 3)):
        chosen = rng.sample(range(len(pages)), rng.randint(1, len(pages)))
        refs.append([(i, rng.choice([pages[i], max(1, pages[i] // 2)])) for i in chosen])
    bpc = rng.randint(1, 3)
    offset = rng.choice([0, 0, 16, 104])
    extra = rng.choice([None, 0, 48])
    return tensors, refs, bpc, offset, extra


def caches(tensors, refs):
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, int(t.shape[1]) if t.dim() > 1 else 1) for t in tensors],
                             [[CanonicalKVCacheRef(i, p) for i, p in grp] for grp in refs])


def random_job(rng: random.Random, layout: KVLayout, scattered: bool):
    """A spec over distinct engine blocks (each group a random count, partial first blocks) and its slots."""
    sizes = [rng.randint(0, 5) for _ in layout.groups]
    starts = [rng.randint(0, 7) for _ in layout.groups]
    ids = rng.sample(range(ENGINE_BLOCKS), sum(sizes))
    spec = GPULoadStoreSpec(ids, sizes, starts)
    needed = layout.slots_needed(spec)
    if scattered:
        slots = rng.sample(range(SLOTS), needed)
    else:
        first = rng.randint(0, SLOTS - needed)
        slots = list(range(first, first + needed))
    return spec, slots


@pytest.mark.parametrize("seed", range(40))
def test_plan_moves_the_bytes_gather_and_scatter_move(seed):
    rng = random.Random(seed)
    tensors, refs, bpc, offset, extra = random_layout(rng)
    probe = KVLayout(caches(tensors, refs), bpc)
    length = None if extra is None else probe.block_bytes + extra
    ref_tensors = [t.clone() for t in tensors]
    plan_tensors = [t.clone() for t in tensors]
    ref = KVLayout(caches(ref_tensors, refs), bpc, offset, length)
    planned = KVLayout(caches(plan_tensors, refs), bpc, offset, length)
    stride = ref.slot_end + rng.choice([0, 8, 100])
    try:
        spec, slots = random_job(rng, ref, scattered=seed % 2 == 0)
        rows = torch.tensor(slots, dtype=torch.int64)
        # store: engine -> slots, starting from the same random region bytes
        region = torch.randint(0, 256, (SLOTS, stride), dtype=torch.uint8)
        expected, got = region.clone(), region.clone()
        ref.gather(expected, rows, ref.index(spec, len(slots)))
        execute(plan_copies(planned, spec, slots, got, to_cpu=True))
        assert torch.equal(got, expected)
        # load: slots -> engine (bytes outside the layout's range of each slot never read)
        execute(plan_copies(planned, spec, slots, region, to_cpu=False))
        ref.scatter(region, rows, ref.index(spec, len(slots)))
        for a, b in zip(ref_tensors, plan_tensors):
            assert torch.equal(a, b)
        if sum(spec.group_sizes):  # not vacuous: the job moved bytes both ways
            assert not torch.equal(got, region)
            assert any(not torch.equal(t, u) for t, u in zip(tensors, plan_tensors))
    finally:
        ref.close()
        planned.close()


def one_tensor(page: int, refs_pages=(None,), bpc: int = 1):
    t = torch.arange(ENGINE_BLOCKS * page, dtype=torch.int64).to(torch.uint8).view(ENGINE_BLOCKS, page)
    refs = [[(0, page if p is None else p) for p in refs_pages]]
    return KVLayout(caches([t], refs), bpc)


def test_consecutive_pages_into_consecutive_slots_merge_into_one_descriptor():
    layout = one_tensor(256)
    region = torch.zeros((SLOTS, 256), dtype=torch.uint8)
    spec = GPULoadStoreSpec(range(4, 12))
    plan = plan_copies(layout, spec, list(range(3, 11)), region, to_cpu=True)
    assert len(plan) == 1 and plan.nbytes == 8 * 256
    assert int(plan.src[0]) == layout.tensors[0].data_ptr() + 4 * 256
    assert int(plan.dst[0]) == region.data_ptr() + 3 * 256
    load = plan_copies(layout, spec, list(range(3, 11)), region, to_cpu=False)
    assert len(load) == 1 and int(load.dst[0]) == int(plan.src[0])


def test_scattered_slots_or_padded_slots_keep_one_descriptor_per_page():
    layout = one_tensor(256)
    spec = GPULoadStoreSpec(range(8))
    slots = [5, 1, 9, 3, 7, 0, 2, 11]
    assert len(plan_copies(layout, spec, slots, torch.zeros((SLOTS, 256), dtype=torch.uint8), True)) == 8
    # consecutive slots whose rows are wider than the page: places are not adjacent
    assert len(plan_copies(layout, spec, list(range(8)), torch.zeros((SLOTS, 512), dtype=torch.uint8), True)) == 8


def test_sub_blocks_of_one_slot_merge_per_reference():
    """4 engine blocks per slot, unpadded pages: each slot's run of sub-blocks is one descriptor."""
    layout = one_tensor(256, refs_pages=(256,), bpc=4)
    region = torch.zeros((SLOTS, layout.block_bytes), dtype=torch.uint8)
    plan = plan_copies(layout, GPULoadStoreSpec(range(8)), [6, 2], region, True)
    assert len(plan) == 2 and plan.nbytes == 8 * 256
    partial = plan_copies(layout, GPULoadStoreSpec(range(5), [5], [2]), [6, 2], region, True)
    assert sorted(partial.size.tolist()) == [2 * 256, 3 * 256]  # sub-blocks 2-3 of slot 6, 0-2 of slot 2
    first = int(np.flatnonzero(partial.size == 2 * 256)[0])
    assert int(partial.dst[first]) == region.data_ptr() + 6 * region.stride(0) + 2 * 256


def test_coalesce_merges_only_runs_adjacent_on_both_sides():
    src = np.array([300, 0, 100, 200], dtype=np.int64)
    dst = np.array([1300, 1000, 1100, 5000], dtype=np.int64)
    plan = coalesce(src, dst, np.full(4, 100, dtype=np.int64))
    assert plan.src.tolist() == [0, 200, 300] and plan.dst.tolist() == [1000, 5000, 1300]
    assert plan.size.tolist() == [200, 100, 100] and plan.nbytes == 400


def test_bad_slots_and_geometry_are_refused_with_the_cause():
    layout = one_tensor(256)
    region = torch.zeros((4, 256), dtype=torch.uint8)
    with pytest.raises(IndexError, match="slot 4 outside the region's 4 slots"):
        plan_copies(layout, GPULoadStoreSpec([0]), [4], region, True)
    with pytest.raises(ValueError, match="cover 2 slots, the tier spec has 1"):
        plan_copies(layout, GPULoadStoreSpec([0, 1]), [0], region, True)
    with pytest.raises(ValueError, match="region rows hold 128 B, the layout needs 256 B"):
        plan_copies(layout, GPULoadStoreSpec([0]), [0], torch.zeros((4, 128), dtype=torch.uint8), True)
    assert len(plan_copies(layout, GPULoadStoreSpec([]), [], region, True)) == 0
    assert math.isclose(plan_copies(layout, GPULoadStoreSpec([3]), [2], region, False).nbytes, 256)
