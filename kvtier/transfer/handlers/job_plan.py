"""A job's copy plan in a few microseconds: the planner the CUDA handlers run on the submitting thread.

`kvtier.transfer.handlers.copy_plan.plan_copies` is the reference: readable, vectorised over numpy,
and slow enough to starve the copy stream at small pages (index tensors per group, arrays per
reference, a sort to merge runs; measured figures: docs/benchmarks.md, "Issue 37"). `plan_job`
gives the same descriptors for a fraction of that:

- the layout's geometry is reduced once (`PlanGeometry`: per reference of each group, the engine
  tensor's address and row stride, the page and its place in the slot), and a CPU region to
  `RegionRef` (address, row stride, rows) once per handler;
- a job is then one pass over the spec's lists, in job order (group, reference, block), in
  compiled code (`kvtier.transfer.handlers._job_plan`, built by setup.py) or, where that is not built,
  its pure-Python twin `plan_job_py` (numpy, same arrays);
- a descriptor that continues the previous one on both sides is merged into it, so runs adjacent
  in job order (sub-blocks of one slot, consecutive engine blocks into consecutive slots, the
  merges a contiguous job has) become one descriptor. The reference sorts by source address
  first, so it also merges runs that a job lists in another order (descending blocks into
  descending slots); `coalesce(plan_job(...))` equals `plan_copies(...)` in every case, and
  the two plans move the same bytes (tests/handlers/test_job_plan.py).

Same checks as the reference (ValueError for the geometry, IndexError for a slot or engine block
out of range), raised before any descriptor is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from kvtier.core.specs import GPULoadStoreSpec
from kvtier.transfer.handlers.copy_plan import CopyPlan
from kvtier.transfer.handlers.kv_layout import KVLayout

UNLOADED: Any = object()
# The compiled planner (kvtier/transfer/handlers/_job_plan.pyx), imported at the first plan (it imports
# numpy, which `import kvtier` must not); None where it is not built: the pure-Python twin then.
compiled: Any = UNLOADED


def compiled_planner() -> Any:
    """The compiled planner module, or None where it was not built (no compiler at install)."""
    global compiled
    if compiled is UNLOADED:
        try:
            from kvtier.transfer.handlers import _job_plan
        except ImportError:
            compiled = None
        else:
            compiled = _job_plan
    return compiled


@dataclass(frozen=True)
class PlanGeometry:
    """A layout's references as int64 arrays: the references of group `g` are entries
    `seg_first[g]:seg_first[g + 1]`; entry `s` copies `page[s]` bytes of engine block `b` from
    `engine_base[s] + b * engine_stride[s]`, to byte `place[s] + sub * page[s]` of a slot (`place`
    includes the layout's `slot_offset`)."""

    seg_first: Any
    engine_base: Any
    engine_stride: Any
    page: Any
    place: Any
    bpc: int
    engine_blocks: int
    slot_end: int

    @classmethod
    def of(cls, layout: KVLayout) -> PlanGeometry:
        """The geometry of `layout` (made at its first job, then kept on the layout)."""
        cached = layout.plan_geometry
        if cached is None:
            cached = layout.plan_geometry = cls._build(layout)
        return cached

    @classmethod
    def _build(cls, layout: KVLayout) -> PlanGeometry:
        import numpy as np

        first, base, stride, page, place = [0], [], [], [], []
        for segments in layout.groups:
            for seg in segments:
                rows = layout.engine_rows(seg.tensor_idx, seg.page)  # row r = engine block r's page
                base.append(rows.data_ptr())
                stride.append(rows.stride(0) * rows.element_size())
                page.append(seg.page)
                place.append(layout.slot_offset + seg.offset)
            first.append(len(base))
        first_a, base_a, stride_a, page_a, place_a = (np.asarray(a, dtype=np.int64)
                                                      for a in (first, base, stride, page, place))
        return cls(first_a, base_a, stride_a, page_a, place_a, layout.blocks_per_chunk, layout.num_engine_blocks,
                   layout.slot_end)


class RegionRef(NamedTuple):
    """A CPU tier's slots as plain numbers: slot `i` starts at `base + i * stride`."""

    base: int
    stride: int
    rows: int
    row_bytes: int

    @classmethod
    def of(cls, region) -> RegionRef:
        """Of a 2-D uint8 tensor, row `i` = slot `i` (any row stride)."""
        return cls(region.data_ptr(), region.stride(0), region.shape[0], region.shape[1])


def plan_job(layout: KVLayout, spec: GPULoadStoreSpec, slots, region, to_cpu: bool) -> CopyPlan:
    """The descriptors of a job between the engine's KV cache and `region` (a `RegionRef`, or a
    tensor as `plan_copies` takes); `slots` the job's slot ids (a list, or any sequence of ints).
    `to_cpu`: engine -> slots (a store), else slots -> engine (a load)."""
    geometry = PlanGeometry.of(layout)
    ref = region if isinstance(region, RegionRef) else RegionRef.of(region)
    if geometry.slot_end > ref.row_bytes:
        raise ValueError(f"region rows hold {ref.row_bytes} B, the layout needs {geometry.slot_end} B")
    slots = slots if isinstance(slots, list) else [int(s) for s in slots]
    module = compiled_planner()
    plan = module.plan_job if module is not None else plan_job_py
    src, dst, size = plan(spec.block_ids, spec.group_sizes, spec.block_indices, slots, geometry.seg_first,
                          geometry.engine_base, geometry.engine_stride, geometry.page, geometry.place, geometry.bpc,
                          geometry.engine_blocks, ref.base, ref.stride, ref.rows, to_cpu)
    return CopyPlan(src, dst, size)


def plan_job_py(block_ids: list, group_sizes: list, block_indices: list | None, slots: list, seg_first, engine_base,
                engine_stride, page, place, bpc: int, engine_blocks: int, region_base: int, region_stride: int,
                region_rows: int, to_cpu: bool) -> tuple[Any, Any, Any]:
    """The pure-Python twin of the compiled planner: `(src, dst, size)` int64 arrays, one entry
    per run of descriptors that continue one another in job order (group, reference, block)."""
    import numpy as np

    groups = len(seg_first) - 1
    if len(group_sizes) != groups:
        raise ValueError(f"spec has {len(group_sizes)} groups, the KV cache {groups}")
    skips = [(block_indices[g] % bpc if block_indices is not None else 0) for g in range(groups)]
    needed = sum((n + skip + bpc - 1) // bpc for n, skip in zip(group_sizes, skips) if n)
    if needed != len(slots):
        raise ValueError(f"engine blocks {group_sizes} (block_indices={block_indices}) cover "
                         f"{needed} slots, the tier spec has {len(slots)}")
    sl = _checked(slots, region_rows, "slot")
    ids = _checked(block_ids, engine_blocks, "engine")
    parts: list[tuple[Any, Any, Any]] = []
    first = slot_at = 0
    for g, (n, skip) in enumerate(zip(group_sizes, skips)):
        if n == 0:
            continue
        p = np.arange(skip, skip + n, dtype=np.int64)
        slot_base = region_base + sl[slot_at + p // bpc] * region_stride
        for s in range(int(seg_first[g]), int(seg_first[g + 1])):
            engine = engine_base[s] + ids[first:first + n] * engine_stride[s]
            slot = slot_base + place[s] + (p % bpc) * page[s]
            parts.append((engine, slot, np.full(n, page[s], dtype=np.int64)))
        first += n
        slot_at += (n + skip + bpc - 1) // bpc
    if not parts:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(3))  # type: ignore[return-value]
    engine, slot, size = (np.concatenate([part[i] for part in parts]) for i in range(3))
    src, dst = (engine, slot) if to_cpu else (slot, engine)
    joins = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(size, starts)


def _checked(values: list, limit: int, what: str):
    """`values` as an int64 array, each in [0, limit): else IndexError naming the first that is not."""
    import numpy as np

    out = np.asarray(values, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((out < 0) | (out >= limit))
    if len(bad):
        v = int(out[bad[0]])
        if what == "slot":
            raise IndexError(f"slot {v} outside the region's {limit} slots")
        raise IndexError(f"engine block id {v} >= {limit} blocks" if v >= 0 else f"engine block id {v} < 0")
    return out
