"""The direct path between the engine's KV cache and a file tier (no CPU-tier slot involved).

A job gathers the engine's pages of each offloaded block into a host staging buffer laid out
exactly like a CPU-tier slot (see `kvtier.handlers.kv_layout` for the layout) and hands one buffer
per block to the file backend's byte API:

    FileBackend.write_blocks(slots, keys, buffers) -> bytes      (journalled on return; see sync_interval)
    FileBackend.read_blocks(slots, keys, buffers) -> bytes       (verifies; IntegrityError)

Loads read into the staging buffer (each pool thread reuses its own) first and scatter into the
engine only after every block verified, so a failed or corrupt read never leaves foreign bytes in
the KV cache; a `StagedLoadSpec` (CPU-region and file slots: vLLM's worker) is one such job. On
CUDA the buffer is pinned and moves with one DMA per job on a stream that waits for the compute
stream. Jobs run on a `ThreadedHandler` pool; an exception fails its job only.

`DirectGPUFileHandler` is the direct variant (docs/gds.md), taken when the KV cache is on CUDA,
kvikio imports and the tier's `io` asks for it (`kvikio`) or `auto` finds GPUDirect Storage
(`kvtier.handlers.file_path`: without it the direct path is slower than the staged one):
payloads move between device memory and the slab with kvikio `CuFile` reads/writes at the
slots' 4 KiB-aligned payload offsets (one future per block, all submitted, then waited), through
GPUDirect Storage where the platform has nvidia-fs and kvikio's compatibility mode otherwise.
Stores checksum each block on the device (`tensor_checksum`) and hand the checksums to
`FileBackend.direct_path.commit_direct` (header pages, then the journal); loads read
the headers first, read the payloads into a device buffer, verify them there, and scatter into
the KV cache only when every block verified (else `IntegrityError`: the job fails, the engine's
blocks are untouched, the bad blocks are forgotten). On CPU tensors the same code runs through
kvikio's host path (tests, with `kvtier.testing.fake_cuda`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

from kvtier.handlers.base import pick_backend, serving
from kvtier.handlers.file_path import file_path, log_choice
from kvtier.handlers.gpu_cpu import EngineJobHandler
from kvtier.handlers.kv_layout import KVLayout, blocks_per_chunk_of
from kvtier.specs import FileLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvtier.tiers.base import BlockFile
from kvtier.tiers.file.checksum import tensor_checksum_async
from kvtier.tiers.file.fileio import ALIGN as _ALIGN  # staging rows start on 4 KiB boundaries (O_DIRECT-friendly)
from kvtier.tiers.file.slot_format import CHECK_CRC32, CHECK_TORCH, payload_crc32
from kvtier.types import CanonicalKVCaches

STAGING_CACHE_BYTES = 256 << 20  # largest staging buffer a handler thread keeps for its next jobs


def aligned_rows(n: int, row_bytes: int, pin: bool = False):
    """A contiguous `(n, stride)` uint8 tensor, `stride` = `row_bytes` rounded up to `_ALIGN`,
    starting on an `_ALIGN`-byte boundary (so every row does); rows hold `row_bytes` bytes each."""
    import torch

    stride = -(-row_bytes // _ALIGN) * _ALIGN
    raw = torch.empty(n * stride + _ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % _ALIGN
    return raw[shift:shift + n * stride].view(n, stride)


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


class StagedLoadSpec(LoadStoreSpec):
    """A load from host-readable tiers: `parts[i] = (spec, positions)` (a `FileLoadStoreSpec`, or
    `HostRegion` slots) as in `CompositeLoadStoreSpec`, which the router would split into one job
    per part (the engine's spec cannot be split by block): one `GPUFileHandler` job instead."""

    def __init__(self, parts):
        self.parts = [(spec, [int(p) for p in positions]) for spec, positions in parts]

    def __len__(self) -> int:
        return sum(len(positions) for _, positions in self.parts)

    @staticmethod
    def medium() -> str:
        return "MIXED"


class GPUFileHandler(EngineJobHandler):
    """Engine KV cache <-> file tier through staging buffers (`to_file` selects the direction);
    loading, also `StagedLoadSpec` jobs whose host regions are in `backends` too."""

    def __init__(self, backends: Mapping[str, Any], layout: KVLayout, to_file: bool, num_threads: int = 2):
        super().__init__(layout, num_threads, "kvtier-gpu-file")
        self.backends, self.to_file = dict(backends), to_file
        self._streams: dict[int, Any] = {}
        self._local = threading.local()  # `staging`: this thread's staging buffer, reused by its next jobs

    def _staging(self, k: int):
        """`aligned_rows(k, block_bytes)`, kept by this thread up to STAGING_CACHE_BYTES (a fresh
        one faults its pages in during the read: ~25 ms per 40 MiB here)."""
        held = getattr(self._local, "staging", None)
        if held is None or held.shape[0] < k:
            held = aligned_rows(k, self.layout.block_bytes, pin=self.cuda)
            if held.numel() <= STAGING_CACHE_BYTES:
                self._local.staging = held
        return held[:k]

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        if isinstance(src, StagedLoadSpec) and isinstance(dst, GPULoadStoreSpec) and not self.to_file:
            return self._load_staged(src, dst)
        gpu, file_spec, backend = _gpu_file_job(src, dst, self.to_file, self.backends, self.layout.block_bytes)
        k = len(file_spec.block_ids)
        keys = [bytes(key) for key in file_spec.keys]
        staging = self._staging(k)
        blocks = staging[:, :self.layout.block_bytes]
        if self.to_file:
            staging.zero_()  # bytes no sub-block covers (partial first block) are written as zeros
            self._engine_to_host(gpu, staging, k)
            backend.write_blocks(file_spec.block_ids, keys, _buffers(blocks))
        else:
            backend.read_blocks(file_spec.block_ids, keys, _buffers(blocks))
            self._host_to_engine(gpu, staging, k)
        return self.layout.bytes_of(gpu)

    def _load_staged(self, src: StagedLoadSpec, gpu: GPULoadStoreSpec) -> int:
        """Every part's blocks into their rows of one staging buffer (file blocks verified
        first: `IntegrityError` fails the job before anything reaches the engine), then one scatter."""
        import torch

        n, k = self.layout.block_bytes, len(src)
        staging = self._staging(k)
        rows = _buffers(staging[:, :n])
        for spec, positions in sorted(src.parts, key=lambda part: not isinstance(part[0], FileLoadStoreSpec)):
            if isinstance(spec, FileLoadStoreSpec):  # (first: a failed verification copies nothing)
                _, _, backend = _gpu_file_job(spec, gpu, False, self.backends, n)
                backend.read_blocks(spec.block_ids, [bytes(key) for key in spec.keys], [rows[p] for p in positions])
                continue
            region, at = pick_backend(self.backends, spec, "host"), torch.tensor(positions, dtype=torch.int64)
            if region.block_bytes < n:
                raise ValueError(f"tier {region.name!r} has {region.block_bytes} B blocks, the KV layout needs {n} B")
            staging[at, :n] = region.tensor()[torch.tensor(spec.block_ids, dtype=torch.int64), :n]
        self._host_to_engine(gpu, staging, k)
        return self.layout.bytes_of(gpu)

    # ------------------------------------------------------------------ engine side
    def _engine_to_host(self, gpu: GPULoadStoreSpec, staging, k: int) -> None:
        import torch

        if not self.cuda:
            index = self.layout.index(gpu, k)
            self.layout.gather(staging, torch.arange(k), index)
            return
        with self._on_stream() as stream:
            index = self.layout.index(gpu, k)
            device_rows = torch.zeros(staging.shape, dtype=torch.uint8, device=self.layout.device)
            self.layout.gather(device_rows, torch.arange(k), index)
            staging.copy_(device_rows, non_blocking=True)
            _finish(stream)

    def _host_to_engine(self, gpu: GPULoadStoreSpec, staging, k: int) -> None:
        import torch

        if not self.cuda:
            index = self.layout.index(gpu, k)
            self.layout.scatter(staging, torch.arange(k), index)
            return
        with self._on_stream() as stream:
            index = self.layout.index(gpu, k)
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

        from kvtier.tiers.file import fileio

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
            from kvtier.tiers.file import fileio

            fileio._kvikio_threads.release(self._defaults)


def _io_array(row):
    """What kvikio accepts for a tensor row: the tensor itself on CUDA (it exposes
    `__cuda_array_interface__`), a numpy view of it on the host."""
    return row if row.is_cuda else row.numpy()


class DirectGPUFileHandler(GPUFileHandler):
    """Engine KV cache <-> file tier with kvikio moving payloads straight to and from the device
    buffer of a job (module docstring). `copy` is the whole job; a failure raises (job failed)."""

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
        """A `(k, stride)` uint8 buffer on the KV cache's device, one 4 KiB-aligned row per block
        (zeroed for stores: bytes no sub-block covers are written as zeros)."""
        import torch

        stride = -(-self.layout.block_bytes // _ALIGN) * _ALIGN
        make = torch.zeros if zeroed else torch.empty
        return make((k, stride), dtype=torch.uint8, device=self.layout.device)

    def _transfer(self, backend, slots, rows, write: bool) -> None:
        """Move each block's payload between `rows[i]` and slot `slots[i]`: one future per block,
        all submitted before any is waited on; raises OSError if any moved a short count."""
        cufile = self._slab_file(backend).file
        n = self.layout.block_bytes
        call = cufile.pwrite if write else cufile.pread
        offset = backend.direct_path.payload_offset
        futures = [call(_io_array(rows[i, :n]), n, offset(slot)) for i, slot in enumerate(slots)]
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
        import torch

        headers = backend.direct_path.read_headers(slots, keys)
        bad = [(slot, why) for slot, why in zip(slots, headers) if isinstance(why, str)]
        if bad:
            backend.direct_path.reject(bad)
        rows = self._device_rows(len(slots), zeroed=False)  # no kernel: kvikio fills it
        self._transfer(backend, slots, rows, write=False)
        with self._engine_stream():
            bad = self._verify(rows, slots, headers)
            if bad:
                backend.direct_path.reject(bad)
            self.layout.scatter(rows, torch.arange(len(slots)), self.layout.index(gpu, len(slots)))
            if self.cuda:
                torch.cuda.current_stream(self.layout.device).synchronize()

    def _verify(self, rows, slots, headers) -> list[tuple[int, str]]:
        """(slot, why) of each row whose payload does not match its header's checksum: torch
        checksums on the device; a CRC-32 (a block stored by the host path) on a host copy."""
        n = self.layout.block_bytes
        on_device = [i for i, h in enumerate(headers) if h.check_kind == CHECK_TORCH]
        found = dict(zip(on_device, self._checksums(rows[on_device]) if on_device else []))
        for i, header in enumerate(headers):
            if header.check_kind == CHECK_CRC32:
                found[i] = payload_crc32(rows[i, :n].cpu().numpy())
        return [(slots[i], "payload checksum mismatch") for i, h in enumerate(headers) if found[i] != h.payload_crc]

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

