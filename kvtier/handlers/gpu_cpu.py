"""Copies between the engine's KV cache (`CanonicalKVCaches`) and the CPU tier, in batches.

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

Hot path: index tensors are built once per job (no per-block Python loop) and every
(group, reference) pair is one gather plus one scatter (`index_select` / row assignment) over rows
reinterpreted as the widest integer type the alignment allows. On CUDA the copies run on a
dedicated stream that first waits for the compute stream, through a device staging buffer laid out
like the slots, with one DMA per job between it and the pinned region; a completion thread waits
for the job's event.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.handlers.base import SyncHandler, ThreadedHandler, TransferHandler
from kvtier.specs import BlockIDsLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvtier.types import CanonicalKVCaches

log = logging.getLogger("kvtier.handlers.gpu_cpu")


def _words(t):
    """`t` (a uint8 tensor whose last dim is contiguous) viewed as the widest integer type that
    divides its last size, its strides and its address; copies move words instead of bytes."""
    import torch

    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if (t.shape[-1] % width == 0 and t.data_ptr() % width == 0
                and all(s % width == 0 for s in t.stride()[:-1])):
            return t.view(dtype)
    return t


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
    """Maps offloaded blocks (slots) to pages of the engine's KV cache; see the module docstring."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int = 1):
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        if not kv_caches.tensors:
            raise ValueError("CanonicalKVCaches has no tensors")
        self.blocks_per_chunk = bpc = blocks_per_chunk
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.device = self.tensors[0].device
        self.num_engine_blocks = min(t.shape[0] for t in self.tensors)
        refs = kv_caches.group_data_refs or [
            [_Ref(i, t.page_size_bytes) for i, t in enumerate(kv_caches.tensors)]]
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
        self._rows: dict[tuple[int, int], Any] = {}
        self._local = threading.local()

    def engine_rows(self, tensor_idx: int, page: int):
        """`(num_blocks, page)` word view of one engine tensor (cached)."""
        key = (tensor_idx, page)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = _words(byte_rows(self.tensors[tensor_idx], page))
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
    def _slot_view(self, slots, seg: Segment):
        """How to address sub-block `sub` of `seg` in row `r` of the slot tensor `slots`:
        `(view, per_row, first)`, `view` 2-D with row `r * per_row + first + sub`, when every
        sub-block is a row of one uniform view (the usual case), else `(view3d, None, None)`
        indexed `[r, sub]`."""
        row_stride = slots.stride(0)
        page, bpc = seg.page, self.blocks_per_chunk
        if row_stride % page == 0 and seg.offset % page == 0:
            per_row = row_stride // page
            flat = slots.as_strided((slots.shape[0] * per_row, page), (page, 1), slots.storage_offset())
            return _words(flat), per_row, seg.offset // page
        view3 = slots.as_strided((slots.shape[0], bpc, page), (row_stride, page, 1),
                                 slots.storage_offset() + seg.offset)
        return _words(view3), None, None

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

    def _pairs(self, slots, rows, index: list[GroupIndex]):
        """For every (group, reference): engine rows, slot view, engine ids, slot-view positions
        (host tensors; positions are `(row, sub)` pairs for a 3-D view)."""
        for gi in index:
            row = rows[gi.pos]
            for seg in self.groups[gi.group]:
                engine = self.engine_rows(seg.tensor_idx, seg.page)
                view, per_row, first = self._slot_view(slots, seg)
                engine, view = _common_words(engine, view)
                where = row * per_row + first + gi.sub if per_row is not None else (row, gi.sub)
                yield engine, view, gi.ids, where

    def gather(self, slots, rows, index: list[GroupIndex]) -> None:
        """Engine pages -> sub-blocks of `slots[rows[pos]]` (`slots` a uint8 `(R, >= block_bytes)`
        tensor on the engine's device; `rows` a host int64 tensor)."""
        for engine, view, ids, where in self._pairs(slots, rows, index):
            dev = engine.device
            if isinstance(where, tuple):
                view[where[0].to(dev), where[1].to(dev)] = engine.index_select(0, ids.to(dev))
                continue
            m, at, src_at = len(ids), _run_start(where), _run_start(ids)
            if at is not None:
                _index_select(engine, ids.to(dev), view[at:at + m])
            elif src_at is not None:
                _index_copy(view, where.to(dev), engine[src_at:src_at + m])
            else:
                buf = self._scratch(m, engine)
                _index_select(engine, ids.to(dev), buf)
                _index_copy(view, where.to(dev), buf)

    def scatter(self, slots, rows, index: list[GroupIndex]) -> None:
        """Sub-blocks of `slots[rows[pos]]` -> engine pages (the inverse of `gather`)."""
        for engine, view, ids, where in self._pairs(slots, rows, index):
            dev = engine.device
            if isinstance(where, tuple):
                engine.index_copy_(0, ids.to(dev), view[where[0].to(dev), where[1].to(dev)])
                continue
            m, at, dst_at = len(ids), _run_start(where), _run_start(ids)
            if at is not None:
                _index_copy(engine, ids.to(dev), view[at:at + m])
            elif dst_at is not None and engine[dst_at:dst_at + m].is_contiguous():
                _index_select(view, where.to(dev), engine[dst_at:dst_at + m])
            else:
                buf = self._scratch(m, view)
                _index_select(view, where.to(dev), buf)
                _index_copy(engine, ids.to(dev), buf)


# A host row copy this large is split across torch's intra-op threads (torch's index_select and
# numpy's row assignment release the GIL): on this project's 2-core machine one thread moves
# 6-7 GB/s, two 11-14 GB/s like one contiguous copy (index_select alone uses one thread for rows
# of 256 KiB-1 MiB).
_PARALLEL_COPY_BYTES = 4 << 20
_copy_pool: tuple[int, Any] | None = None  # (threads, ThreadPoolExecutor), made on first use
_copy_pool_lock = threading.Lock()


def _in_parts(rows: int, nbytes: int, copy_rows: Callable[[int, int], None]) -> None:
    """`copy_rows(start, stop)` over `0..rows`: at once, or for a large host copy in one part
    per torch thread, run side by side (the parts must write disjoint rows)."""
    import torch

    threads = torch.get_num_threads()
    if threads < 2 or rows < 2 or nbytes < _PARALLEL_COPY_BYTES:
        copy_rows(0, rows)
        return
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None or _copy_pool[0] != threads:
            from concurrent.futures import ThreadPoolExecutor

            _copy_pool = (threads, ThreadPoolExecutor(threads, thread_name_prefix="kvtier-rows"))
        pool = _copy_pool[1]
    cuts = [rows * i // threads for i in range(threads + 1)]
    for part in [pool.submit(copy_rows, cuts[i], cuts[i + 1]) for i in range(threads)]:
        part.result()


def _index_select(src, index, out) -> None:
    """`out[i] = src[index[i]]` along dim 0 (`torch.index_select(..., out=out)`). On the host, in
    parts, with numpy's unbuffered `take` where `out` is contiguous (torch's index_select, run from
    two threads, runs into its own intra-op threads: 9.6 GB/s against 13.6 for 1 MiB rows here)."""
    import torch

    if out.device.type != "cpu" or src.device.type != "cpu":
        torch.index_select(src, 0, index, out=out)
        return
    nbytes = out.numel() * out.element_size()
    try:
        import numpy as np

        if not (out.is_contiguous() and src.is_contiguous()):
            raise RuntimeError("strided")
        values, rows, dst = src.numpy(), index.numpy(), out.numpy()
    except (ImportError, RuntimeError):  # no numpy, or a strided view: torch's index_select
        _in_parts(len(index), nbytes, lambda a, b: torch.index_select(src, 0, index[a:b], out=out[a:b]))
        return
    if len(rows) and (rows.min() < 0 or rows.max() >= len(values)):
        raise IndexError(f"row index out of range 0..{len(values) - 1}: {rows.min()}..{rows.max()}")
    if dst.shape != (len(rows), *values.shape[1:]):
        raise ValueError(f"index_select: out has shape {dst.shape}, expected {(len(rows), *values.shape[1:])}")
    # mode="clip" (indices checked above) keeps numpy from buffering `out`.
    _in_parts(len(rows), nbytes, lambda a, b: np.take(values, rows[a:b], axis=0, out=dst[a:b], mode="clip"))


def _index_copy(dst, index, src) -> None:
    """`dst[index[i]] = src[i]` along dim 0. On the host numpy's row assignment (one memcpy per
    row) runs at memory speed where torch's `index_copy_` reaches about 75% of it; it runs in
    parts when the rows are distinct (repeated rows: numpy's order, the last one wins)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        try:
            out, rows, values = dst.numpy(), index.numpy(), src.numpy()
        except RuntimeError:  # torch built without numpy support
            pass
        else:
            if values.nbytes < _PARALLEL_COPY_BYTES or len(set(rows.tolist())) != len(rows):
                out[rows] = values  # one call (repeated rows must not be split across parts)
                return

            def copy_rows(a: int, b: int) -> None:
                out[rows[a:b]] = values[a:b]

            _in_parts(len(rows), values.nbytes, copy_rows)
            return
    dst.index_copy_(0, index, src)


def _run_start(positions) -> int | None:
    """`positions[0]` if `positions` (host int64) is `start, start+1, ...`, else None."""
    m = len(positions)
    if m == 0:
        return None
    first = int(positions[0])
    if int(positions[-1]) - first != m - 1:
        return None
    if m > 1 and not bool((positions[1:] - positions[:-1] == 1).all()):
        return None
    return first


def _common_words(a, b):
    """`a` and `b` reinterpreted with the narrower of their integer types (same bytes per row)."""
    import torch

    if a.element_size() == b.element_size():
        return a, b
    if a.element_size() > b.element_size():
        return a.view(torch.uint8).view(b.dtype), b
    return a, b.view(torch.uint8).view(a.dtype)


@dataclass
class ChunkedKVCaches(CanonicalKVCaches):
    """`CanonicalKVCaches` plus the number of engine blocks per offloaded block.

    The registry's factory signature `(backends, kv_caches)` carries no chunk size; pass this
    subclass to `build_hierarchy(kv_caches=...)` when `blocks_per_chunk > 1`.
    """

    blocks_per_chunk: int = 1


@dataclass
class _Ref:
    tensor_idx: int
    page_size_bytes: int


def _pick_backend(backends: Mapping[str, Any], spec: BlockIDsLoadStoreSpec):
    tier = getattr(spec, "tier", None)  # vLLM's own specs name no tier
    if tier is not None:
        return backends[tier]
    if len(backends) != 1:
        raise ValueError(f"spec names no tier and there are {len(backends)} CPU tiers")
    return next(iter(backends.values()))


def _split(to_cpu: bool, src: LoadStoreSpec, dst: LoadStoreSpec) -> tuple[GPULoadStoreSpec, BlockIDsLoadStoreSpec]:
    gpu, cpu = (src, dst) if to_cpu else (dst, src)
    if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(cpu, BlockIDsLoadStoreSpec):
        raise TypeError(f"expected a GPU spec and a slot spec, got {type(src).__name__} -> {type(dst).__name__}")
    return gpu, cpu


class HostKVCopyHandler(SyncHandler):
    """Engine KV cache in CPU tensors <-> CPU tier: batched index copies, synchronous in `submit`.
    A failing job reports `success=False`; other jobs are unaffected."""

    def __init__(self, backends: Mapping[str, Any], layout: KVLayout, to_cpu: bool):
        super().__init__()
        self.backends, self.layout, self.to_cpu = dict(backends), layout, to_cpu

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        import torch

        gpu, cpu = _split(self.to_cpu, src, dst)
        backend = _pick_backend(self.backends, cpu)
        if backend.block_bytes < self.layout.block_bytes:
            raise ValueError(f"tier {backend.name!r} has {backend.block_bytes} B blocks, the KV layout needs "
                             f"{self.layout.block_bytes} B")
        index = self.layout.index(gpu, len(cpu.block_ids))
        rows = torch.tensor(cpu.block_ids, dtype=torch.int64)
        if len(rows) and int(rows.max()) >= backend.num_blocks:
            raise IndexError(f"slot {int(rows.max())} >= {backend.num_blocks} slots of tier {backend.name!r}")
        region = backend.tensor()
        if self.to_cpu:
            self.layout.gather(region, rows, index)
        else:
            self.layout.scatter(region, rows, index)
        return self.layout.bytes_of(gpu)


class EngineJobHandler(ThreadedHandler):
    """A `ThreadedHandler` for jobs that touch the engine's KV cache.

    - On CUDA, `submit` records an event on the caller's current (compute) stream; the job's
      thread makes its own stream wait for it (`ready_event()`), so a store reads the KV only after
      the model wrote it and a load writes only after earlier work on those blocks.
    - `wait(job_ids)` returns only after each job's result was reported (`on_done` called).
    """

    def __init__(self, device: Any, num_threads: int, thread_name: str):
        super().__init__(num_threads=num_threads, thread_name=thread_name)
        self.device = device
        self.cuda = device.type == "cuda"
        self._ready: dict[int, Any] = {}
        self._reported: dict[int, threading.Event] = {}
        self._job_lock = threading.Lock()
        self._job_local = threading.local()

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        ready = None
        if self.cuda:
            import torch

            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._job_lock:
            if ready is not None:
                self._ready[job_id] = ready
            self._reported[job_id] = threading.Event()
        super().submit(job_id, src, dst)

    def _run(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        with self._job_lock:
            self._job_local.ready = self._ready.pop(job_id, None)
        try:
            super()._run(job_id, src, dst)  # reports through on_done
        finally:
            with self._job_lock:
                reported = self._reported.pop(job_id, None)
            if reported is not None:
                reported.set()

    def ready_event(self):
        """The compute-stream event of the job running on this thread (None off CUDA)."""
        return getattr(self._job_local, "ready", None)

    def wait(self, job_ids) -> None:
        with self._job_lock:
            pending = [self._reported[j] for j in job_ids if j in self._reported]
        for event in pending:
            event.wait()


class CudaKVCopyHandler(EngineJobHandler):
    """Engine KV cache on CUDA <-> pinned CPU tier.

    One worker thread runs the jobs in submission order on a dedicated stream that first waits for
    the compute stream (see `EngineJobHandler`). A job gathers/scatters on the device through a
    staging buffer laid out like the slots and moves it with one non-blocking DMA when the slots
    are consecutive, else through a pinned bounce buffer and one batched host-side row copy. The
    thread waits for the job's end event, then reports.
    """

    def __init__(self, backends: Mapping[str, Any], layout: KVLayout, to_cpu: bool):
        super().__init__(layout.device, 1, "kvtier-gpu-cpu" if to_cpu else "kvtier-cpu-gpu")
        import torch

        self.backends, self.layout, self.to_cpu = dict(backends), layout, to_cpu
        self.stream = torch.cuda.Stream(device=self.device)

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        import torch

        gpu, cpu = _split(self.to_cpu, src, dst)
        backend = _pick_backend(self.backends, cpu)
        if backend.block_bytes < self.layout.block_bytes:
            raise ValueError(f"tier {backend.name!r} blocks are smaller than the KV layout's {self.layout.block_bytes} B")
        slots = torch.as_tensor(cpu.block_ids, dtype=torch.int64)
        k = len(slots)
        if k and int(slots.max()) >= backend.num_blocks:
            raise IndexError(f"slot {int(slots.max())} >= {backend.num_blocks} slots of tier {backend.name!r}")
        stride = backend.slot_stride
        # Whole slots (row stride = slot_stride): every DMA below is between contiguous tensors.
        region_bytes = backend.tensor().as_strided((backend.num_blocks, stride), (stride, 1))
        region = _words(region_bytes)
        first = _run_start(slots)
        consecutive = first is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            ready = self.ready_event()
            if ready is not None:
                self.stream.wait_event(ready)
            index = self.layout.index(gpu, k)
            rows = torch.arange(k, dtype=torch.int64)
            staging = torch.empty((k, stride), dtype=torch.uint8, device=self.device)
            done = torch.cuda.Event()
            if self.to_cpu:
                self.layout.gather(staging, rows, index)
                if consecutive:
                    region_bytes[first:first + k].copy_(staging, non_blocking=True)
                else:
                    bounce = torch.empty((k, stride), dtype=torch.uint8, pin_memory=True)
                    bounce.copy_(staging, non_blocking=True)
                done.record(self.stream)
                done.synchronize()
                if not consecutive:
                    dst, src_rows = _common_words(region, _words(bounce))
                    _index_copy(dst, slots, src_rows)
            else:
                if consecutive:
                    staging.copy_(region_bytes[first:first + k], non_blocking=True)
                else:
                    bounce = torch.empty((k, stride), dtype=torch.uint8, pin_memory=True)
                    src_rows, out = _common_words(region, _words(bounce))
                    _index_select(src_rows, slots, out)
                    staging.copy_(bounce, non_blocking=True)
                self.layout.scatter(staging, rows, index)
                done.record(self.stream)
                done.synchronize()
        return self.layout.bytes_of(gpu)


class _ArenaRegion:
    """`tensor()` over a `MemoryBackend`'s arena (slots back to back), so the in-process
    memory tier can stand in for the CPU tier (tests, `configs/memory.yaml`)."""

    def __init__(self, backend: Any):
        self.name, self.num_blocks, self.block_bytes = backend.name, backend.num_blocks, backend.block_bytes
        self.slot_stride = backend.block_bytes
        self._arena = backend.arena
        self._tensor = None

    def tensor(self):
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self._arena, dtype=torch.uint8).view(self.num_blocks, self.block_bytes)
        return self._tensor


def cpu_backends(backends: Mapping[str, Any]) -> dict[str, Any]:
    """The backends a GPU<->CPU handler can serve: those exposing `tensor()` (shared/pinned
    regions), and memory tiers (a writable `arena` buffer)."""
    out = {}
    for name, b in backends.items():
        if callable(getattr(b, "tensor", None)):
            out[name] = b
        elif isinstance(getattr(b, "arena", None), (bytearray, mmap.mmap)):
            out[name] = _ArenaRegion(b)
    return out


def make_handler(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None, to_cpu: bool,
                 blocks_per_chunk: int = 1) -> TransferHandler | None:
    """A GPU->CPU (`to_cpu`) or CPU->GPU handler, or None without KV caches or CPU tiers."""
    if kv_caches is None:
        return None
    usable = cpu_backends(backends)
    if not usable:
        return None
    layout = KVLayout(kv_caches, blocks_per_chunk)
    if layout.device.type == "cuda":
        return CudaKVCopyHandler(usable, layout, to_cpu)
    if layout.device.type != "cpu":
        raise ValueError(f"unsupported KV cache device {layout.device}")
    return HostKVCopyHandler(usable, layout, to_cpu)


def _bpc(kv_caches: Any) -> int:
    return int(getattr(kv_caches, "blocks_per_chunk", 1))


def make_gpu_to_cpu(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None) -> TransferHandler | None:
    """Registry factory for GPULoadStoreSpec -> CPULoadStoreSpec."""
    return make_handler(backends, kv_caches, to_cpu=True, blocks_per_chunk=_bpc(kv_caches))


def make_cpu_to_gpu(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None) -> TransferHandler | None:
    """Registry factory for CPULoadStoreSpec -> GPULoadStoreSpec."""
    return make_handler(backends, kv_caches, to_cpu=False, blocks_per_chunk=_bpc(kv_caches))


__all__: Sequence[str] = ["ChunkedKVCaches", "KVLayout", "Segment", "EngineJobHandler", "HostKVCopyHandler",
                          "CudaKVCopyHandler", "byte_rows",
                          "make_gpu_to_cpu", "make_cpu_to_gpu", "make_handler"]
