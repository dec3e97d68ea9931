"""The direct path between the engine's KV cache and a file tier (no CPU-tier slot involved).

A job gathers the engine's pages of each offloaded block into a host staging buffer laid out
exactly like a CPU-tier slot (see `kvtier.transfer.handlers.kv_layout` for the layout) and hands one buffer
per block to the file backend's byte API:

    FileBackend.write_blocks(slots, keys, buffers) -> bytes      (journalled on return; see sync_interval)
    FileBackend.read_blocks(slots, keys, buffers) -> bytes       (verifies; IntegrityError names bad slots)

Loads read into the staging buffer (buffers are reused) first and scatter into the engine only
the blocks that verified (`stage_load`, then `finish_load`, which a caller may run on another
thread): a block that failed is named by `BlocksFailed` and its engine pages are left untouched,
an I/O error leaves the KV cache untouched; a `StagedLoadSpec` (CPU-region and file slots:
vLLM's worker) is one such job. A loading layout that owns only
a range of each slot (`KVLayout(slot_offset=, slot_length=)`: a tensor-parallel rank's part) stages
only that range: its file backend reads that part of each slot (`kvtier.tiers.file.reader`), its
host regions give that range of theirs. On
CUDA the buffer is pinned and moves with one DMA per job on a stream that waits for the compute
stream. Jobs run on a `ThreadedHandler` pool; an exception fails its job only.

`DirectGPUFileHandler` (`kvtier.transfer.handlers.gpu_file_direct`, docs/gds.md) is the kvikio path, taken
where `kvtier.transfer.handlers.file_path` says so.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

from kvtier.core.errors import BlocksFailed, IntegrityError
from kvtier.core.specs import GPULoadStoreSpec, LoadStoreSpec, PartsLoadStoreSpec
from kvtier.core.types import CanonicalKVCaches
from kvtier.tiers.base import BlockFile
from kvtier.tiers.file.fileio import ALIGN as _ALIGN  # staging rows start on 4 KiB boundaries (O_DIRECT-friendly)
from kvtier.tiers.file.spec import FileLoadStoreSpec
from kvtier.transfer.handlers.base import pick_backend, serving
from kvtier.transfer.handlers.cpu_file import failed_slots
from kvtier.transfer.handlers.file_path import file_path, log_choice
from kvtier.transfer.handlers.gpu_cpu import EngineJobHandler
from kvtier.transfer.handlers.kv_layout import GroupIndex, KVLayout, blocks_per_chunk_of

STAGING_CACHE_BYTES = 256 << 20  # largest staging buffer a handler keeps for its next jobs


def aligned_rows(n: int, row_bytes: int, pin: bool = False):
    """A contiguous `(n, stride)` uint8 tensor, `stride` = `row_bytes` rounded up to `_ALIGN`,
    every row starting on an `_ALIGN`-byte boundary."""
    import torch

    stride = -(-row_bytes // _ALIGN) * _ALIGN
    raw = torch.empty(n * stride + _ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % _ALIGN
    return raw[shift:shift + n * stride].view(n, stride)


def without_slots(index: list[GroupIndex], bad: Sequence[int]) -> list[GroupIndex]:
    """`index` (a job's, `KVLayout.index`) without the engine pages of the job slots `bad`."""
    import torch

    drop = torch.tensor(list(bad), dtype=torch.int64)
    kept = []
    for gi in index:
        keep = ~torch.isin(gi.pos, drop)
        kept.append(GroupIndex(gi.group, gi.ids[keep], gi.pos[keep], gi.sub[keep]))
    return kept


def _buffers(staging) -> list:
    """One C-contiguous numpy row per block (buffer protocol, no copy)."""
    array = staging.numpy()
    return [array[i] for i in range(array.shape[0])]


def _gpu_file_job(src: LoadStoreSpec, dst: LoadStoreSpec, to_file: bool, backends: dict[str, Any],
                  block_bytes: int) -> tuple[GPULoadStoreSpec, FileLoadStoreSpec, Any]:
    """A GPU<->FILE job's engine spec, file spec and file tier; `TypeError` for other specs and
    `ValueError` for a tier whose blocks are not the KV layout's size."""
    gpu, file_spec = (src, dst) if to_file else (dst, src)
    if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(file_spec, FileLoadStoreSpec):
        raise TypeError(f"expected GPU and file specs, got {type(src).__name__} -> {type(dst).__name__}")
    backend = pick_backend(backends, file_spec, "file")
    if backend.block_bytes != block_bytes:
        raise ValueError(f"file tier {backend.name!r} stores {backend.block_bytes} B blocks, the KV layout "
                         f"needs {block_bytes} B")
    return gpu, file_spec, backend


class StagedLoadSpec(PartsLoadStoreSpec):
    """A load from host-readable tiers (a `FileLoadStoreSpec`, or `HostRegion` slots, per part)
    that the router would split if it were a `CompositeLoadStoreSpec` (the engine's spec cannot
    be split by block): one `GPUFileHandler` job instead."""

    __slots__ = ()


class GPUFileHandler(EngineJobHandler):
    """Engine KV cache <-> file tier through staging buffers (`to_file` selects the direction);
    loading, also `StagedLoadSpec` jobs whose host regions are in `backends` too."""

    def __init__(self, backends: Mapping[str, Any], layout: KVLayout, to_file: bool, num_threads: int = 2):
        super().__init__(layout, num_threads, "kvtier-gpu-file")
        self.backends, self.to_file = dict(backends), to_file
        # A staged row: the layout's range of a slot (its whole block when it owns the whole slot).
        self.row_bytes = layout.block_bytes if layout.slot_length is None else layout.slot_length
        if to_file and not layout.owns_whole_slot:
            raise ValueError("an engine -> file handler writes whole slots: its layout must own them")
        self._streams: dict[int, Any] = {}
        self._spare: list[Any] = []  # staging buffers given back, for the next jobs (<= num_threads)
        self._spare_lock, self._max_spare = threading.Lock(), num_threads

    def take_staging(self, k: int):
        """A staging buffer of >= `k` rows, spare if one fits (a fresh one faults in its pages
        during the read: ~25 ms per 40 MiB here); `give_back` it after."""
        with self._spare_lock:
            for i, held in enumerate(self._spare):
                if held.shape[0] >= k:
                    return self._spare.pop(i)
        return aligned_rows(k, self.row_bytes, pin=self.cuda)

    def give_back(self, staging) -> None:
        with self._spare_lock:  # (kept up to STAGING_CACHE_BYTES, one per thread)
            if staging.numel() <= STAGING_CACHE_BYTES and len(self._spare) < self._max_spare:
                self._spare.append(staging)

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        if not self.to_file:
            return self.finish_load(*self.stage_load(src, dst))
        n = self.layout.block_bytes
        gpu, file_spec, backend = _gpu_file_job(src, dst, True, self.backends, n)
        staging = self.take_staging(k := len(file_spec.block_ids))
        try:
            staging.zero_()  # bytes no sub-block covers (partial first block) are written as zeros
            self._engine_to_host(gpu, staging[:k], k)
            backend.write_blocks(file_spec.block_ids, list(map(bytes, file_spec.keys)), _buffers(staging[:k, :n]))
        finally:
            self.give_back(staging)
        return self.layout.bytes_of(gpu)

    def stage_load(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> tuple[GPULoadStoreSpec, Any, int,
                                                                           BlocksFailed | None]:
        """A load's first half: each block of `src` (file or staged spec) into its staging row,
        file blocks verified. Returns `finish_load`'s arguments: the engine spec, the buffer, the
        number of blocks and, when some failed verification, the `BlocksFailed` that names them
        (an I/O error raises: nothing reaches the engine)."""
        import torch

        if isinstance(src, FileLoadStoreSpec):
            src = StagedLoadSpec([(src, range(len(src.block_ids)))])
        if not isinstance(src, StagedLoadSpec) or not isinstance(dst, GPULoadStoreSpec):
            raise TypeError(f"expected a file or staged spec -> GPU spec, got {src!r} -> {dst!r}")
        n, k, at = self.row_bytes, len(src), self.layout.slot_offset
        staging = self.take_staging(k)
        bad: list[int] = []
        why: list[str] = []
        try:
            rows = _buffers(staging[:k, :n])
            for spec, positions in src.parts:
                if isinstance(spec, FileLoadStoreSpec):
                    _, _, backend = _gpu_file_job(spec, dst, False, self.backends, n)
                    try:
                        backend.read_blocks(spec.block_ids, [bytes(key) for key in spec.keys],
                                            [rows[p] for p in positions])
                    except IntegrityError as exc:
                        bad += [positions[p] for p in failed_slots(exc, spec.block_ids, n).positions]
                        why.append(str(exc))
                    continue
                region = pick_backend(self.backends, spec, "host")  # (a region of other blocks: shape error)
                part = region.tensor()[torch.tensor(cast(Any, spec).block_ids), at:at + n]
                staging[torch.tensor(positions), :n] = part
        except BaseException:
            self.give_back(staging)
            raise
        if not bad:
            return dst, staging, k, None
        moved = self.layout.bytes_of(dst) * (k - len(bad)) // k
        return dst, staging, k, BlocksFailed("; ".join(why), sorted(bad), moved)

    def finish_load(self, gpu: GPULoadStoreSpec, staging, k: int, failure: BlocksFailed | None = None) -> int:
        """A load's second half (any thread): the staged blocks into the KV cache, but those that
        `failure` names (failed verification: it is raised then, once the others are loaded);
        the bytes moved."""
        try:
            index = self.layout.index(gpu, k)
            self._host_to_engine(staging[:k], without_slots(index, failure.positions) if failure else index)
        finally:
            self.give_back(staging)
        if failure is not None:
            raise failure
        return self.layout.bytes_of(gpu)

    def _engine_to_host(self, gpu: GPULoadStoreSpec, staging, k: int) -> None:
        import torch

        index = self.layout.index(gpu, k)
        if not self.cuda:
            return self.layout.gather(staging, torch.arange(k), index)
        with self._on_stream() as stream:
            device_rows = torch.zeros(staging.shape, dtype=torch.uint8, device=self.layout.device)
            self.layout.gather(device_rows, torch.arange(k), index)
            staging.copy_(device_rows, non_blocking=True)
            _finish(stream)

    def _host_to_engine(self, staging, index: list[GroupIndex]) -> None:
        import torch

        k = staging.shape[0]  # (each row holds the layout's range of a slot from byte 0: base 0)
        if not self.cuda:
            return self.layout.scatter(staging, torch.arange(k), index, base=0)
        with self._on_stream() as stream:
            device_rows = torch.empty(staging.shape, dtype=torch.uint8, device=self.layout.device)
            device_rows.copy_(staging, non_blocking=True)
            self.layout.scatter(device_rows, torch.arange(k), index, base=0)
            _finish(stream)

    def _on_stream(self):
        """Context: this thread's side stream, made to wait for the job's compute-stream event."""
        import torch

        tid = threading.get_ident()
        stream = self._streams.get(tid)
        if stream is None:
            stream = self._streams[tid] = torch.cuda.Stream(device=self.layout.device)

        @contextlib.contextmanager
        def ctx():
            with torch.cuda.device(self.layout.device), torch.cuda.stream(stream):
                ready = self.ready_event()
                if ready is not None:
                    stream.wait_event(ready)
                yield stream
        return ctx()


def _finish(stream) -> None:
    import torch

    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()


def direct_path_available(device, io: str = "auto") -> bool:
    """Whether the direct handler is used for a KV cache on `device` and a file tier with `io`
    (`kvtier.transfer.handlers.file_path.choose_file_path`: with `auto`, only under GPUDirect Storage)."""
    return file_path(io, cuda=getattr(device, "type", None) == "cuda")[0] == "direct"


def _make(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None, to_file: bool) -> GPUFileHandler | None:
    if kv_caches is None:
        return None
    usable = serving(backends, BlockFile)
    if not usable:
        return None
    layout = KVLayout(kv_caches, blocks_per_chunk_of(kv_caches))
    if layout.device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported KV cache device {layout.device}")
    threads = min(4, max(b.num_threads for b in usable.values()))
    choices = {name: _tier_choice(backend, layout.device.type == "cuda") for name, backend in usable.items()}
    staged = [name for name, (choice, _) in choices.items() if choice == "staged"]
    for name, (choice, why) in choices.items():
        if choice == "direct" and staged:  # one handler serves every file tier: it takes the staged path
            choice, why = "staged", f"{why}, but file tier {staged[0]} takes the staged path, and one handler " \
                                    f"serves every file tier"
        log_choice(name, choice, why)
    if staged:
        return GPUFileHandler(usable, layout, to_file, num_threads=threads)
    from kvtier.transfer.handlers.gpu_file_direct import DirectGPUFileHandler  # (it builds on this module's handler)

    return DirectGPUFileHandler(usable, layout, to_file, num_threads=threads)


def _tier_choice(backend: Any, cuda: bool) -> tuple[str, str]:
    """`file_path`'s choice for one file tier, staged where the backend cannot commit direct writes."""
    choice, why = file_path(getattr(backend, "io_option", "auto"), cuda=cuda)
    if choice == "direct" and not hasattr(backend, "direct_path"):
        return "staged", f"{type(backend).__name__} has no direct commit"
    return choice, why


def make_gpu_to_file(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None) -> GPUFileHandler | None:
    """Registry factory for GPULoadStoreSpec -> FileLoadStoreSpec."""
    return _make(backends, kv_caches, to_file=True)


def make_file_to_gpu(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None) -> GPUFileHandler | None:
    """Registry factory for FileLoadStoreSpec -> GPULoadStoreSpec."""
    return _make(backends, kv_caches, to_file=False)

