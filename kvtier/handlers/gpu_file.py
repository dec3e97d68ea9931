"""The direct path between the engine's KV cache and a file tier (no CPU-tier slot involved).

A job gathers the engine's pages of each offloaded block into a host staging buffer laid out
exactly like a CPU-tier slot (see `kvtier.handlers.kv_layout` for the layout) and hands one buffer
per block to the file backend's byte API:

    FileBackend.write_blocks(slots, keys, buffers) -> bytes      (journalled on return; see sync_interval)
    FileBackend.read_blocks(slots, keys, buffers) -> bytes       (verifies; IntegrityError)

Loads read into the staging buffer first and scatter into the engine only after every block
verified, so a failed or corrupt read never leaves foreign bytes in the KV cache. With the engine
on CUDA the staging buffer is pinned and moves with one DMA per job on a dedicated stream that
waits for the compute stream. Jobs run on a `ThreadedHandler` pool; an exception fails its job only.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvtier.handlers.base import pick_backend, serving
from kvtier.handlers.gpu_cpu import EngineJobHandler
from kvtier.handlers.kv_layout import KVLayout, blocks_per_chunk_of
from kvtier.specs import FileLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvtier.tiers.base import BlockFile
from kvtier.tiers.fileio import ALIGN as _ALIGN  # staging rows start on 4 KiB boundaries (O_DIRECT-friendly)
from kvtier.types import CanonicalKVCaches


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


class GPUFileHandler(EngineJobHandler):
    """Engine KV cache <-> file tier through per-job staging buffers (`to_file` selects the direction)."""

    def __init__(self, backends: Mapping[str, Any], layout: KVLayout, to_file: bool, num_threads: int = 2):
        super().__init__(layout, num_threads, "kvtier-gpu-file")
        self.backends, self.to_file = dict(backends), to_file
        self._streams: dict[int, Any] = {}

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        gpu, file_spec = (src, dst) if self.to_file else (dst, src)
        if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(file_spec, FileLoadStoreSpec):
            raise TypeError(f"expected GPU and file specs, got {type(src).__name__} -> {type(dst).__name__}")
        backend = pick_backend(self.backends, file_spec, "file")
        if backend.block_bytes != self.layout.block_bytes:
            raise ValueError(f"file tier {backend.name!r} stores {backend.block_bytes} B blocks, the KV layout "
                             f"needs {self.layout.block_bytes} B")
        k = len(file_spec.block_ids)
        keys = [bytes(key) for key in file_spec.keys]
        staging = aligned_rows(k, self.layout.block_bytes, pin=self.cuda)
        blocks = staging[:, :self.layout.block_bytes]
        if self.to_file:
            staging.zero_()  # bytes no sub-block covers (partial first block) are written as zeros
            self._engine_to_host(gpu, staging, k)
            backend.write_blocks(file_spec.block_ids, keys, _buffers(blocks))
        else:
            backend.read_blocks(file_spec.block_ids, keys, _buffers(blocks))
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
        import contextlib

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
    return GPUFileHandler(usable, layout, to_file, num_threads=threads)


def make_gpu_to_file(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None) -> GPUFileHandler | None:
    """Registry factory for GPULoadStoreSpec -> FileLoadStoreSpec."""
    return _make(backends, kv_caches, to_file=True)


def make_file_to_gpu(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None) -> GPUFileHandler | None:
    """Registry factory for FileLoadStoreSpec -> GPULoadStoreSpec."""
    return _make(backends, kv_caches, to_file=False)

