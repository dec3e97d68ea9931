"""`KVLayout`: where the pages of the engine's KV cache (`CanonicalKVCaches`) go in an offloaded block.

Layout of one offloaded block (one slot, one KV group `g`, `bpc = blocks_per_chunk`): for each
reference `r` of `group_data_refs[g]`, in order, `bpc` consecutive pages of `r.page_size_bytes`
bytes (engine sub-block 0 first):

    slot = [ref 0: page(sub 0) page(sub 1) ... page(sub bpc-1)] [ref 1: ...] ...

so `group_bytes[g] = bpc * sum(r.page_size_bytes)` and the tier's `block_bytes` must be
`max(group_bytes)` (`KVLayout.block_bytes`; equal to the sum whenever the groups have the same
page sizes). Bytes of a slot past its group's size are never written or read.

A `GPULoadStoreSpec` lists, group after group, the engine blocks of a job; the destination (or
source) spec lists the slots, group after group too. Group `g` with `n` engine blocks whose first
block has logical index `i` skips `s = i % bpc` sub-blocks of its first slot and covers
`ceil((n + s) / bpc)` slots. Only covered sub-blocks are written or read.

A layout may own only a byte range of each slot (`slot_offset`, `slot_length`): the part of one
worker rank when several ranks share a slot (rank `r` of the vLLM adapter owns
`[r * P, (r + 1) * P)`). Everything above then holds inside that range: the pages start at
`slot_offset`, and no byte of the slot outside `[slot_offset, slot_offset + slot_length)` is
written or read. By default a layout owns the whole slot from byte 0.

Hot path: index tensors are built once per job (no per-block Python loop) and every
(group, reference) pair is one gather plus one scatter (`index_select` / row assignment, through the
layout's `RowCopier`) over rows reinterpreted as the widest integer type the alignment allows.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

from kvtier.core.specs import GPULoadStoreSpec
from kvtier.core.types import CanonicalKVCacheRef, CanonicalKVCaches
from kvtier.transfer.handlers.rows import RowCopier, common_words, run_start, words


def byte_rows(tensor, page: int):
    """A `(num_blocks, page)` uint8 view of an engine KV tensor whose dim 0 is the block (any
    dtype; `stride(0)` may exceed the page). Byte `k` of block `b` is byte `k` of its page."""
    import torch

    es = tensor.element_size()
    if tensor.dim() < 1 or (tensor.dim() > 1 and tensor.stride(-1) != 1):
        raise ValueError(f"KV tensor must have a contiguous last dimension, got strides {tensor.stride()}")
    flat = tensor.view(torch.uint8) if es > 1 or tensor.dtype != torch.uint8 else tensor
    row_stride = tensor.stride(0) * es
    if page > row_stride and tensor.shape[0] > 1:
        raise ValueError(f"page of {page} bytes exceeds the row stride {row_stride} of a KV tensor")
    return flat.as_strided((tensor.shape[0], page), (row_stride, 1), flat.storage_offset())


@dataclass(frozen=True)
class Segment:
    """One reference of a group: `page` bytes of engine tensor `tensor_idx` per sub-block, stored
    at byte `offset` of the slot (sub-block `j` at `offset + j * page`)."""

    tensor_idx: int
    page: int
    offset: int


@dataclass
class GroupIndex:
    """Index tensors of one group of a job: engine block `ids[k]` <-> sub-block `sub[k]` of job slot `pos[k]`."""

    group: int
    ids: Any
    pos: Any
    sub: Any


class KVLayout:
    """Maps offloaded blocks (slots) to pages of the engine's KV cache; see the module docstring.

    Its host copies run on `copier`, a `RowCopier` it owns: `close()` shuts that down (the
    handler that made the layout closes it with itself). A layout used only for its geometry
    (`block_bytes`, `index`) starts no thread and needs no `close`.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int = 1, slot_offset: int = 0,
                 slot_length: int | None = None):
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        if not kv_caches.tensors:
            raise ValueError("CanonicalKVCaches has no tensors")
        self.blocks_per_chunk = bpc = blocks_per_chunk
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.device = self.tensors[0].device
        self.num_engine_blocks = min(t.shape[0] for t in self.tensors)
        refs = kv_caches.group_data_refs or [
            [CanonicalKVCacheRef(i, t.page_size_bytes) for i, t in enumerate(kv_caches.tensors)]]
        self.groups: list[list[Segment]] = []
        for refs_of_group in refs:
            offset, segments = 0, []
            for ref in refs_of_group:
                page = ref.page_size_bytes
                if page > kv_caches.tensors[ref.tensor_idx].page_size_bytes:
                    raise ValueError(f"reference page {page} B exceeds tensor {ref.tensor_idx}'s page")
                segments.append(Segment(ref.tensor_idx, page, offset))
                offset += bpc * page
            self.groups.append(segments)
        self.group_bytes = [sum(bpc * s.page for s in g) for g in self.groups]
        self.block_bytes = max(self.group_bytes)
        self.slot_offset, self.slot_length = _check_range(slot_offset, slot_length, self.block_bytes)
        self._rows: dict[tuple[int, int], Any] = {}
        self.plan_geometry: Any = None  # `job_plan.PlanGeometry` of this layout, made at its first planned job
        self._local = threading.local()
        self.copier = RowCopier()

    @property
    def owns_whole_slot(self) -> bool:
        """True when no other layout's bytes share a slot with this one (no `slot_length` given)."""
        return self.slot_length is None

    @property
    def slot_end(self) -> int:
        """Bytes a slot must have for this layout: `slot_offset` + its part (`slot_length`, or
        `block_bytes` for a layout that owns the whole slot)."""
        return self.slot_offset + (self.block_bytes if self.slot_length is None else self.slot_length)

    def close(self) -> None:
        """Stop the copier's threads. Idempotent; copies still work afterwards, unsplit."""
        self.copier.close()

    def engine_rows(self, tensor_idx: int, page: int):
        """`(num_blocks, page)` word view of one engine tensor (cached)."""
        key = (tensor_idx, page)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = words(byte_rows(self.tensors[tensor_idx], page))
        return rows

    # ------------------------------------------------------------------ indices
    def slots_needed(self, spec: GPULoadStoreSpec) -> int:
        """Number of slots a job over `spec` covers."""
        bpc = self.blocks_per_chunk
        skips = spec.block_indices or [0] * len(spec.group_sizes)
        return sum(math.ceil((n + i % bpc) / bpc) for n, i in zip(spec.group_sizes, skips) if n)

    def bytes_of(self, spec: GPULoadStoreSpec) -> int:
        """Bytes a job over `spec` moves."""
        return sum(n * self.group_bytes[g] // self.blocks_per_chunk for g, n in enumerate(spec.group_sizes))

    def index(self, spec: GPULoadStoreSpec, num_slots: int) -> list[GroupIndex]:
        """Host index tensors of a job (positions into the job's slot list); validates the geometry."""
        import torch

        if len(spec.group_sizes) != len(self.groups):
            raise ValueError(f"spec has {len(spec.group_sizes)} groups, the KV cache {len(self.groups)}")
        needed = self.slots_needed(spec)
        if needed != num_slots:
            raise ValueError(f"engine blocks {spec.group_sizes} (block_indices={spec.block_indices}) cover "
                             f"{needed} slots, the tier spec has {num_slots}")
        bpc = self.blocks_per_chunk
        all_ids = torch.tensor(spec.block_ids, dtype=torch.int64)
        if len(all_ids) and (int(all_ids.max()) >= self.num_engine_blocks):
            raise IndexError(f"engine block id {int(all_ids.max())} >= {self.num_engine_blocks} blocks")
        skips = spec.block_indices or [0] * len(spec.group_sizes)
        out, first, slot = [], 0, 0
        for g, (n, logical) in enumerate(zip(spec.group_sizes, skips)):
            if n == 0:
                continue
            skip = logical % bpc
            p = torch.arange(skip, skip + n, dtype=torch.int64)
            out.append(GroupIndex(g, all_ids[first:first + n], slot + p // bpc, p % bpc))
            first += n
            slot += math.ceil((n + skip) / bpc)
        return out

    # ------------------------------------------------------------------ copies
    def _slot_view(self, slots, seg: Segment, base: int):
        """How to address sub-block `sub` of `seg` in row `r` of the slot tensor `slots` whose
        rows hold this layout's pages from byte `base` on: `(view, per_row, first)`, `view` 2-D
        with row `r * per_row + first + sub`, when every sub-block is a row of one uniform view
        (the usual case), else `(view3d, None, None)` indexed `[r, sub]`."""
        row_stride = slots.stride(0)
        page, bpc, offset = seg.page, self.blocks_per_chunk, base + seg.offset
        if row_stride % page == 0 and offset % page == 0:
            per_row = row_stride // page
            first = offset // page
            # Rows up to the last sub-block of the last slot (not past the tensor's storage).
            count = (slots.shape[0] - 1) * per_row + first + bpc if slots.shape[0] else 0
            flat = slots.as_strided((count, page), (page, 1), slots.storage_offset())
            return words(flat), per_row, first
        view3 = slots.as_strided((slots.shape[0], bpc, page), (row_stride, page, 1),
                                 slots.storage_offset() + offset)
        return words(view3), None, None

    def _scratch(self, rows: int, like):
        """A reused `(rows, like.shape[1])` buffer for gathered pages (host: fresh large
        allocations cost a page fault per 4 KiB, more than the copy itself)."""
        import torch

        if like.device.type != "cpu":
            return torch.empty((rows, like.shape[1]), dtype=like.dtype, device=like.device)
        need = rows * like.shape[1] * like.element_size()
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < need:
            buf = self._local.scratch = torch.empty(need, dtype=torch.uint8)
        return buf[:need].view(like.dtype).view(rows, like.shape[1])

    def _pairs(self, slots, rows, index: list[GroupIndex], base: int):
        """For every (group, reference): engine rows, slot view, engine ids, slot-view positions
        (host tensors; positions are `(row, sub)` pairs for a 3-D view)."""
        for gi in index:
            row = rows[gi.pos]
            for seg in self.groups[gi.group]:
                engine = self.engine_rows(seg.tensor_idx, seg.page)
                view, per_row, first = self._slot_view(slots, seg, base)
                engine, view = common_words(engine, view)
                where = row * per_row + first + gi.sub if per_row is not None else (row, gi.sub)
                yield engine, view, gi.ids, where

    def gather(self, slots, rows, index: list[GroupIndex], base: int | None = None) -> None:
        """Engine pages -> sub-blocks of `slots[rows[pos]]` (`slots` a uint8 `(R, >= slot_end)`
        tensor on the engine's device; `rows` a host int64 tensor). The pages go from byte `base`
        of each row on (default `slot_offset`; 0 for a staging buffer that holds only this part)."""
        base = self.slot_offset if base is None else base
        for engine, view, ids, where in self._pairs(slots, rows, index, base):
            dev = engine.device
            if isinstance(where, tuple):
                view[where[0].to(dev), where[1].to(dev)] = engine.index_select(0, ids.to(dev))
                continue
            m, at, src_at = len(ids), run_start(where), run_start(ids)
            if at is not None:
                self.copier.index_select(engine, ids.to(dev), view[at:at + m])
            elif src_at is not None:
                self.copier.index_copy(view, where.to(dev), engine[src_at:src_at + m])
            else:
                buf = self._scratch(m, engine)
                self.copier.index_select(engine, ids.to(dev), buf)
                self.copier.index_copy(view, where.to(dev), buf)

    def scatter(self, slots, rows, index: list[GroupIndex], base: int | None = None) -> None:
        """Sub-blocks of `slots[rows[pos]]` -> engine pages (the inverse of `gather`)."""
        base = self.slot_offset if base is None else base
        for engine, view, ids, where in self._pairs(slots, rows, index, base):
            dev = engine.device
            if isinstance(where, tuple):
                engine.index_copy_(0, ids.to(dev), view[where[0].to(dev), where[1].to(dev)])
                continue
            m, at, dst_at = len(ids), run_start(where), run_start(ids)
            if at is not None:
                self.copier.index_copy(engine, ids.to(dev), view[at:at + m])
            elif dst_at is not None and engine[dst_at:dst_at + m].is_contiguous():
                self.copier.index_select(view, where.to(dev), engine[dst_at:dst_at + m])
            else:
                buf = self._scratch(m, view)
                self.copier.index_select(view, where.to(dev), buf)
                self.copier.index_copy(engine, ids.to(dev), buf)


@dataclass
class ChunkedKVCaches(CanonicalKVCaches):
    """`CanonicalKVCaches` plus the number of engine blocks per offloaded block.

    The registry's factory signature `(backends, kv_caches)` carries no chunk size; pass this
    subclass to `build_hierarchy(kv_caches=...)` when `blocks_per_chunk > 1`.
    """

    blocks_per_chunk: int = 1
    slot_offset: int = 0
    slot_length: int | None = None


def _check_range(offset: int, length: int | None, block_bytes: int) -> tuple[int, int | None]:
    """Validated `(slot_offset, slot_length)` of a layout whose pages take `block_bytes`."""
    if offset < 0:
        raise ValueError(f"slot_offset must be >= 0, got {offset}")
    if length is not None and length < block_bytes:
        raise ValueError(f"slot_length {length} B is smaller than the KV pages of one block ({block_bytes} B); "
                         f"it must be at least that")
    return int(offset), None if length is None else int(length)


def blocks_per_chunk_of(kv_caches: Any) -> int:
    """Engine blocks per offloaded block of `kv_caches` (`ChunkedKVCaches` says; else 1)."""
    return int(getattr(kv_caches, "blocks_per_chunk", 1))


def slot_range_of(kv_caches: Any) -> tuple[int, int | None]:
    """`(slot_offset, slot_length)` of `kv_caches` (`ChunkedKVCaches` says; else the whole slot)."""
    return int(getattr(kv_caches, "slot_offset", 0)), getattr(kv_caches, "slot_length", None)
