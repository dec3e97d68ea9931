"""The fast job planner (`kvtier.transfer.handlers.job_plan`): its compiled and pure-Python twins give the
same arrays, and both the descriptors of the reference `plan_copies` (once merged the way the
reference merges), over random layouts and jobs in any block and slot order."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_copy_plan import ENGINE_BLOCKS, SLOTS, caches, execute, one_tensor, random_layout

from kvtier import GPULoadStoreSpec
from kvtier.transfer.handlers import job_plan
from kvtier.transfer.handlers.copy_plan import CopyPlan, coalesce, plan_copies
from kvtier.transfer.handlers.job_plan import RegionRef, plan_job, plan_job_py
from kvtier.transfer.handlers.kv_layout import KVLayout

torch = pytest.importorskip("torch")


def test_the_compiled_planner_is_built():
    """This machine has a C compiler: a silent fallback to the twin here is a build bug."""
    assert job_plan.compiled_planner() is not None, ("kvtier.transfer.handlers._job_plan is not built: run "
                                                     "`python setup.py build_ext --inplace`")


def both(layout, spec, slots, region, to_cpu: bool) -> CopyPlan:
    """The compiled plan, asserted equal, array for array, to the pure-Python twin's."""
    fast = plan_job(layout, spec, slots, region, to_cpu)
    assert job_plan.compiled_planner() is not None
    saved, job_plan.compiled = job_plan.compiled, None
    try:
        twin = plan_job(layout, spec, slots, region, to_cpu)
    finally:
        job_plan.compiled = saved
    for a, b in ((fast.src, twin.src), (fast.dst, twin.dst), (fast.size, twin.size)):
        assert a.dtype == b.dtype == np.int64 and a.tolist() == b.tolist()
    return fast


def assert_same_plan(a: CopyPlan, b: CopyPlan) -> None:
    assert (a.src.tolist(), a.dst.tolist(), a.size.tolist()) == (b.src.tolist(), b.dst.tolist(), b.size.tolist())


def any_order_job(rng: random.Random, layout: KVLayout):
    """A job whose engine blocks and slots come in one of four orders: ascending runs (what merges
    in job order), descending runs (what only the reference's sort merges), or shuffled."""
    sizes = [rng.randint(0, 6) for _ in layout.groups]
    starts = [rng.randint(0, 7) for _ in layout.groups]
    spec_probe = GPULoadStoreSpec(list(range(sum(sizes))), sizes, starts)
    needed = layout.slots_needed(spec_probe)
    order = rng.choice(["ascending", "descending", "shuffled", "mixed"])
    first_id, first_slot = rng.randint(0, ENGINE_BLOCKS - sum(sizes)), rng.randint(0, SLOTS - needed)
    ids = list(range(first_id, first_id + sum(sizes)))
    slots = list(range(first_slot, first_slot + needed))
    if order == "descending":
        ids.reverse()
        slots.reverse()
    elif order == "shuffled":
        ids, slots = rng.sample(range(ENGINE_BLOCKS), len(ids)), rng.sample(range(SLOTS), needed)
    elif order == "mixed":
        rng.shuffle(slots)
    return GPULoadStoreSpec(ids, sizes, starts), slots


def random_layouts(rng: random.Random, count: int) -> list[KVLayout]:
    """`count` layouts of one random geometry (`test_copy_plan.random_layout`), each over its own
    copy of the engine tensors."""
    tensors, refs, bpc, offset, extra = random_layout(rng)
    probe = KVLayout(caches(tensors, refs), bpc)
    length = None if extra is None else probe.block_bytes + extra
    probe.close()
    return [KVLayout(caches([t.clone() for t in tensors], refs), bpc, offset, length) for _ in range(count)]


@pytest.mark.parametrize("seed", range(60))
def test_the_fast_plan_is_the_reference_plan_merged_in_job_order(seed):
    rng = random.Random(1000 + seed)
    (layout,) = random_layouts(rng, 1)
    stride = layout.slot_end + rng.choice([0, 8, 100])
    region = torch.randint(0, 256, (SLOTS, stride), dtype=torch.uint8)
    ref_region = RegionRef.of(region) if seed % 2 else region  # either form
    try:
        for _ in range(4):
            spec, slots = any_order_job(rng, layout)
            for to_cpu in (True, False):
                fast = both(layout, spec, slots, ref_region, to_cpu)
                reference = plan_copies(layout, spec, slots, region, to_cpu)
                assert_same_plan(coalesce(fast.src, fast.dst, fast.size), reference)
                assert len(fast) >= len(reference) and fast.nbytes == reference.nbytes
                if spec.block_ids == sorted(spec.block_ids) and slots == sorted(slots):
                    assert len(fast) == len(reference)  # ascending runs: every merge the reference makes
    finally:
        layout.close()


@pytest.mark.parametrize("seed", range(20))
def test_the_fast_plan_moves_the_bytes_the_reference_moves(seed):
    rng = random.Random(2000 + seed)
    fast_layout, ref_layout = random_layouts(rng, 2)
    mine, theirs = fast_layout.tensors, ref_layout.tensors
    try:
        spec, slots = any_order_job(rng, fast_layout)
        region = torch.randint(0, 256, (SLOTS, fast_layout.slot_end + 16), dtype=torch.uint8)
        got, expected = region.clone(), region.clone()
        execute(plan_job(fast_layout, spec, slots, got, True))
        execute(plan_copies(ref_layout, spec, slots, expected, True))
        assert torch.equal(got, expected)
        loaded = torch.randint(0, 256, region.shape, dtype=torch.uint8)
        execute(plan_job(fast_layout, spec, slots, loaded, False))
        execute(plan_copies(ref_layout, spec, slots, loaded, False))
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        if sum(spec.group_sizes):
            assert not torch.equal(got, region)  # not vacuous
    finally:
        fast_layout.close()
        ref_layout.close()


def test_runs_merge_in_job_order_as_the_reference_merges_them():
    layout = one_tensor(256)
    region = torch.zeros((SLOTS, 256), dtype=torch.uint8)
    spec = GPULoadStoreSpec(range(4, 12))
    plan = both(layout, spec, list(range(3, 11)), region, True)
    assert len(plan) == 1 and plan.nbytes == 8 * 256
    assert int(plan.src[0]) == layout.tensors[0].data_ptr() + 4 * 256 and int(plan.dst[0]) == region.data_ptr() + 768
    scattered = both(layout, spec, [5, 1, 9, 3, 7, 0, 2, 11], region, False)
    assert len(scattered) == 8 and scattered.dst.tolist() == [layout.tensors[0].data_ptr() + b * 256
                                                              for b in range(4, 12)]  # job order
    chunked = one_tensor(256, refs_pages=(256,), bpc=4)
    wide = torch.zeros((SLOTS, chunked.block_bytes), dtype=torch.uint8)
    partial = both(chunked, GPULoadStoreSpec(range(5), [5], [2]), [6, 2], wide, True)
    assert partial.size.tolist() == [2 * 256, 3 * 256]  # sub-blocks 2-3 of slot 6, 0-2 of slot 2
    backwards = both(layout, GPULoadStoreSpec([7, 6, 5]), [2, 1, 0], region, True)
    assert len(backwards) == 3 and len(plan_copies(layout, GPULoadStoreSpec([7, 6, 5]), [2, 1, 0], region, True)) == 1


@pytest.mark.parametrize("planner", ["compiled", "twin"])
def test_bad_jobs_are_refused_with_the_references_errors(planner, monkeypatch):
    if planner == "twin":
        monkeypatch.setattr(job_plan, "compiled", None)
    layout = one_tensor(256)
    region = torch.zeros((4, 256), dtype=torch.uint8)
    cases = [
        (GPULoadStoreSpec([0]), [4], region, IndexError, "slot 4 outside the region's 4 slots"),
        (GPULoadStoreSpec([0, 1]), [0], region, ValueError, "cover 2 slots, the tier spec has 1"),
        (GPULoadStoreSpec([0]), [0], torch.zeros((4, 128), dtype=torch.uint8), ValueError,
         "region rows hold 128 B, the layout needs 256 B"),
        (GPULoadStoreSpec([ENGINE_BLOCKS]), [0], region, IndexError, f"engine block id {ENGINE_BLOCKS} >= "),
        (GPULoadStoreSpec([0], [1, 0]), [0], region, ValueError, "spec has 2 groups, the KV cache 1"),
    ]
    for spec, slots, where, error, message in cases:
        with pytest.raises(error, match=message):
            plan_job(layout, spec, slots, where, True)
        with pytest.raises(error):
            plan_copies(layout, spec, slots, where, True)
    empty = plan_job(layout, GPULoadStoreSpec([]), [], region, True)
    assert len(empty) == 0 and empty.nbytes == 0


def test_the_twin_alone_matches_its_signature():
    """`plan_job_py` is callable as the compiled function is (the arrays `PlanGeometry` holds)."""
    layout = one_tensor(64)
    geometry = job_plan.PlanGeometry.of(layout)
    assert job_plan.PlanGeometry.of(layout) is geometry  # made once per layout
    src, dst, size = plan_job_py([1, 2], [2], None, [3, 0], geometry.seg_first, geometry.engine_base,
                                 geometry.engine_stride, geometry.page, geometry.place, geometry.bpc,
                                 geometry.engine_blocks, 1 << 20, 64, 4, False)
    assert src.tolist() == [(1 << 20) + 3 * 64, 1 << 20] and size.tolist() == [64, 64]
    assert dst.tolist() == [layout.tensors[0].data_ptr() + 64, layout.tensors[0].data_ptr() + 128]
