"""A job's copies as raw descriptors: (source address, destination address, bytes), device-agnostic.

`plan_copies` turns one engine <-> CPU-tier job (a `GPULoadStoreSpec` and its slot ids, through
a `KVLayout`'s geometry: groups, references, `blocks_per_chunk`, the skipped sub-blocks of a
partial first block, the layout's byte range `slot_offset`/`slot_length` of each slot) into three
int64 numpy arrays, one entry per contiguous copy between an engine page and its place in its
slot. Each page moves straight to or from its slot: no staging, no bounce buffer. Runs that are
consecutive on both sides (engine pages adjacent in memory and their slot places adjacent) are
merged into one descriptor, so consecutive slots of unpadded KV tensors take a few large copies.

The plan only does arithmetic on addresses; who executes it is the caller's choice (a CUDA batch
copy or a compiled `cudaMemcpyAsync` loop, `kvtier.transfer.handlers.cuda_copy`; a host `memmove` in the
tests). Contract: destinations of one plan never overlap (a job names each engine block and each
slot place once), so descriptors may run in any order or all at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.core.specs import GPULoadStoreSpec
from kvtier.transfer.handlers.kv_layout import KVLayout


@dataclass(frozen=True)
class CopyPlan:
    """Descriptor `i` copies `size[i]` bytes from address `src[i]` to address `dst[i]` (int64 arrays)."""

    src: Any
    dst: Any
    size: Any

    def __len__(self) -> int:
        return len(self.size)

    @property
    def nbytes(self) -> int:
        """Bytes the plan moves."""
        return int(self.size.sum())


def plan_copies(layout: KVLayout, spec: GPULoadStoreSpec, slots, region, to_cpu: bool) -> CopyPlan:
    """The descriptors of a job between the engine's KV cache (`layout.tensors`) and `region`.

    `region` is the CPU tier's slot tensor (2-D uint8, row `i` = slot `i`, any row stride: the
    backend's `tensor()` viewed with `slot_stride`), `slots` the job's slot ids in spec order
    (a sequence or an int64 array). `to_cpu` copies engine -> slots (a store), else slots ->
    engine (a load). Validates the geometry as `KVLayout.index` does (ValueError, IndexError)
    and that every slot is a row of `region` (IndexError).
    """
    import numpy as np

    slot_ids = np.asarray(slots, dtype=np.int64).reshape(-1)
    if len(slot_ids) and (int(slot_ids.min()) < 0 or int(slot_ids.max()) >= region.shape[0]):
        bad = int(slot_ids.max()) if int(slot_ids.max()) >= region.shape[0] else int(slot_ids.min())
        raise IndexError(f"slot {bad} outside the region's {region.shape[0]} slots")
    if layout.slot_end > region.shape[1]:
        raise ValueError(f"region rows hold {region.shape[1]} B, the layout needs {layout.slot_end} B")
    index = layout.index(spec, len(slot_ids))
    slot_base = region.data_ptr() + layout.slot_offset + slot_ids * region.stride(0)
    engine_parts, slot_parts, size_parts = [], [], []
    for gi in index:
        ids = gi.ids.numpy()
        places = slot_base[gi.pos.numpy()]  # the slot of each engine block of the group
        sub = gi.sub.numpy()
        for seg in layout.groups[gi.group]:
            rows = layout.engine_rows(seg.tensor_idx, seg.page)  # cached view: row r = block r's page
            engine_parts.append(rows.data_ptr() + ids * (rows.stride(0) * rows.element_size()))
            slot_parts.append(places + seg.offset + sub * seg.page)
            size_parts.append(np.full(len(ids), seg.page, dtype=np.int64))
    if not size_parts:
        empty = np.zeros(0, dtype=np.int64)
        return CopyPlan(empty, empty.copy(), empty.copy())
    engine, place, size = (np.concatenate(p).astype(np.int64, copy=False)
                           for p in (engine_parts, slot_parts, size_parts))
    src, dst = (engine, place) if to_cpu else (place, engine)
    return coalesce(src, dst, size)


def coalesce(src, dst, size) -> CopyPlan:
    """Merge descriptors that continue one another on both sides into one (vectorised).

    Sorted by source address, descriptor `i + 1` joins `i` when `src[i] + size[i] == src[i + 1]`
    and `dst[i] + size[i] == dst[i + 1]`. Any two such descriptors become neighbours after the
    sort, since sources of one plan do not overlap."""
    import numpy as np

    src, dst, size = (np.asarray(a, dtype=np.int64) for a in (src, dst, size))
    if len(size) <= 1:
        return CopyPlan(src.copy(), dst.copy(), size.copy())
    order = np.argsort(src, kind="stable")
    src, dst, size = src[order], dst[order], size[order]
    joins = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return CopyPlan(src[starts], dst[starts], np.add.reduceat(size, starts))
