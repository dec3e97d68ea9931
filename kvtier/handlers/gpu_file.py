"""The direct path between the engine's KV cache and a file tier (no CPU-tier slot involved).

A job gathers the engine's pages of each offloaded block into a host staging buffer laid out
exactly like a CPU-tier slot (see `kvtier.handlers.kv_layout` for the layout) and hands one buffer
per block to the file backend's byte API:

    FileBackend.write_blocks(slots, keys, buffers) -> bytes      (journalled on return; see sync_interval)
    FileBackend.read_blocks(slots, keys, buffers) -> bytes       (verifies; IntegrityError)

Loads read into the staging buffer (buffers are reused) first and scatter into the engine only
after every block verified (`stage_load`, then `finish_load`, which a caller may run on another
thread), so a failed or corrupt read never leaves foreign bytes in the KV cache; a
`StagedLoadSpec` (CPU-region and file slots: vLLM's worker) is one such job. On
CUDA the buffer is pinned and moves with one DMA per job on a stream that waits for the compute
stream. Jobs run on a `ThreadedHandler` pool; an exception fails its job only.

`DirectGPUFileHandler` (docs/gds.md), taken with the KV cache on CUDA, kvikio importable and the
tier's `io` `kvikio` (or `auto` finding GPUDirect Storage, `kvtier.handlers.file_path`), moves
payloads between device memory and the slab with kvikio `CuFile` futures at the slots' 4 KiB-
aligned payload offsets (GDS with nvidia-fs, else kvikio's compatibility mode). Stores checksum
each block on the device and `FileBackend.direct_path.commit_direct` them; loads read the headers,
the payloads into a device buffer, verify there, and scatter only when every block verified (else
`IntegrityError`, the engine untouched, the bad blocks forgotten). On CPU tensors it runs through
kvikio's host path (tests, with `kvtier.testing.fake_cuda`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

from kvtier.errors import BlocksFailed, IntegrityError
from kvtier.handlers.base import pick_backend, serving
from kvtier.handlers.cpu_file import failed_slots
from kvtier.handlers.file_path import file_path, log_choice
from kvtier.handlers.gpu_cpu import EngineJobHandler
from kvtier.handlers.kv_layout import GroupIndex, KVLayout, blocks_per_chunk_of
from kvtier.specs import FileLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec, PartsLoadStoreSpec
from kvtier.tiers.base import BlockFile
from kvtier.tiers.file import fileio
from kvtier.tiers.file.checksum import tensor_checksum_async
from kvtier.tiers.file.fileio import ALIGN as _ALIGN  # staging rows start on 4 KiB boundaries (O_DIRECT-friendly)
from kvtier.tiers.file.slot_format import CHECK_CRC32, CHECK_TORCH, payload_crc32
from kvtier.types import CanonicalKVCaches

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
        return aligned_rows(k, self.layout.block_bytes, pin=self.cuda)

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
        n, k = self.layout.block_bytes, len(src)
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
                staging[torch.tensor(positions), :n] = region.tensor()[torch.tensor(cast(Any, spec).block_ids), :n]
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

        k = staging.shape[0]
        if not self.cuda:
            return self.layout.scatter(staging, torch.arange(k), index)
        with self._on_stream() as stream:
            device_rows = torch.empty(staging.shape, dtype=torch.uint8, device=self.layout.device)
            device_rows.copy_(staging, non_blocking=True)
            self.layout.scatter(device_rows, torch.arange(k), index)
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


class _SlabFile:
    """A kvikio `CuFile` on one file tier's slab, in compatibility mode unless the platform has
    GPUDirect Storage (the same rule as `fileio.KvikioIO`: cuFile is never started where it can
    hang). The tier validated and locked its root_dir; this opens the slab it names."""

    def __init__(self, path: str, num_threads: int):
        import kvikio
        import kvikio.defaults

        compat = {} if fileio.gds_platform() else {"compat_mode": kvikio.CompatMode.ON}
        with kvikio.defaults.set(compat) if compat else contextlib.nullcontext():
            self.file = kvikio.CuFile(path, "r+")
        self._defaults = kvikio.defaults
        # kvikio's thread pool is process-wide: hold a lease of `num_threads` like the tier's `KvikioIO`
        fileio._kvikio_threads.lease(kvikio.defaults, num_threads)

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            fileio._kvikio_threads.release(self._defaults)


def _io_array(row):
    """What kvikio accepts for a tensor row: the tensor on CUDA, a numpy view of it on the host."""
    return row if row.is_cuda else row.numpy()


class DirectGPUFileHandler(GPUFileHandler):
    """Engine KV cache <-> file tier, kvikio moving payloads to/from device buffers (module docstring)."""

    def __init__(self, backends: Mapping[str, Any], layout: KVLayout, to_file: bool, num_threads: int = 2):
        super().__init__(backends, layout, to_file, num_threads)
        self._files: dict[str, _SlabFile] = {}
        self._files_lock = threading.Lock()

    def _slab_file(self, backend) -> _SlabFile:
        with self._files_lock:
            opened = self._files.get(backend.name)
            if opened is None:
                opened = self._files[backend.name] = _SlabFile(str(backend.slab_path), backend.num_threads)
            return opened

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        gpu, file_spec, backend = _gpu_file_job(src, dst, self.to_file, self.backends, self.layout.block_bytes)
        slots, keys = list(file_spec.block_ids), [bytes(key) for key in file_spec.keys]
        if self.to_file:
            self._store(backend, gpu, slots, keys)
        else:
            self._load(backend, gpu, slots, keys)
        return self.layout.bytes_of(gpu)

    def _device_rows(self, k: int, zeroed: bool):
        """A `(k, stride)` uint8 device buffer, 4 KiB-aligned rows (zeroed for stores: gaps write zeros)."""
        import torch

        stride = -(-self.layout.block_bytes // _ALIGN) * _ALIGN
        make = torch.zeros if zeroed else torch.empty
        return make((k, stride), dtype=torch.uint8, device=self.layout.device)

    def _transfer(self, backend, slots, rows, write: bool, rows_at: Sequence[int] | None = None) -> None:
        """`rows[rows_at[i]]` (default `rows[i]`) <-> slot `slots[i]`'s payload, one future each, all
        submitted, then all waited (OSError)."""
        cufile = self._slab_file(backend).file
        n = self.layout.block_bytes
        call = cufile.pwrite if write else cufile.pread
        offset = backend.direct_path.payload_offset
        at = range(len(slots)) if rows_at is None else rows_at
        futures = [call(_io_array(rows[i, :n]), n, offset(slot)) for i, slot in zip(at, slots)]
        moved, error = [], None
        for future in futures:  # wait for all: none may still be in flight when we fail
            try:
                moved.append(future.get())
            except RuntimeError as exc:  # kvikio reports I/O errors and EOF so
                error = error or OSError(f"kvikio {'write' if write else 'read'} failed: {exc}")
        if error is not None:
            raise error
        short = [slot for slot, got in zip(slots, moved) if got != n]
        if short:
            raise OSError(f"kvikio moved short counts for slots {short[:8]} of {backend.slab_path}")

    def _checksums(self, rows) -> list[int]:
        """The payload checksum of each row, computed where the rows are, fetched with one copy."""
        import torch

        n = self.layout.block_bytes
        return torch.stack([tensor_checksum_async(rows[i, :n]) for i in range(rows.shape[0])]).tolist()

    def _store(self, backend, gpu: GPULoadStoreSpec, slots, keys) -> None:
        import torch

        with self._engine_stream():
            rows = self._device_rows(len(slots), zeroed=True)
            self.layout.gather(rows, torch.arange(len(slots)), self.layout.index(gpu, len(slots)))
            checks = self._checksums(rows)  # synchronises: the rows are complete before kvikio reads them
        self._transfer(backend, slots, rows, write=True)
        backend.direct_path.commit_direct(slots, keys, checks, CHECK_TORCH)

    def _load(self, backend, gpu: GPULoadStoreSpec, slots, keys) -> None:
        """Read, verify and scatter the blocks of `slots`; those whose header or payload fails
        are forgotten and not scattered (`BlocksFailed` names them: the others were loaded)."""
        import torch

        headers = backend.direct_path.read_headers(slots, keys)
        rows = self._device_rows(len(slots), zeroed=False)  # no kernel: kvikio fills it
        ok = [i for i, header in enumerate(headers) if not isinstance(header, str)]  # (the others are not read)
        self._transfer(backend, [slots[i] for i in ok], rows, write=False, rows_at=ok)
        with self._engine_stream():
            bad = {i: why for i, why in enumerate(headers) if isinstance(why, str)}
            bad.update(self._verify(rows, headers))
            index = self.layout.index(gpu, len(slots))
            self.layout.scatter(rows, torch.arange(len(slots)), without_slots(index, sorted(bad)) if bad else index)
            if self.cuda:
                torch.cuda.current_stream(self.layout.device).synchronize()
        if bad:
            error = backend.direct_path.reject([(slots[i], why) for i, why in sorted(bad.items())])
            moved = self.layout.bytes_of(gpu) * (len(slots) - len(bad)) // len(slots)
            raise BlocksFailed(str(error), sorted(bad), moved)

    def _verify(self, rows, headers) -> dict[int, str]:
        """Position -> why, for each row not matching its header's checksum (torch on the device;
        CRC-32 on the host); rows whose header already failed (a string) are not looked at."""
        n = self.layout.block_bytes
        on_device = [i for i, h in enumerate(headers) if not isinstance(h, str) and h.check_kind == CHECK_TORCH]
        found = dict(zip(on_device, self._checksums(rows[on_device]) if on_device else []))
        for i, header in enumerate(headers):
            if not isinstance(header, str) and header.check_kind == CHECK_CRC32:
                found[i] = payload_crc32(rows[i, :n].cpu().numpy())
        return {i: "payload checksum mismatch" for i, h in enumerate(headers)
                if not isinstance(h, str) and found[i] != h.payload_crc}

    def _engine_stream(self):
        """This thread's side stream on CUDA (waiting for the job's compute-stream event), else nothing."""
        return self._on_stream() if self.cuda else contextlib.nullcontext()

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            with self._files_lock:
                for opened in self._files.values():
                    opened.close()
                self._files.clear()


def direct_path_available(device, io: str = "auto") -> bool:
    """Whether the direct handler is used for a KV cache on `device` and a file tier with `io`
    (`kvtier.handlers.file_path.choose_file_path`: with `auto`, only under GPUDirect Storage)."""
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
    handler = GPUFileHandler if staged else DirectGPUFileHandler
    return handler(usable, layout, to_file, num_threads=threads)


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

