"""The direct path of the engine <-> file hop: kvikio moves payloads between device memory and the
slab (`DirectGPUFileHandler`, docs/gds.md), taken with the KV cache on CUDA, kvikio importable and
the tier's `io` `kvikio` (or `auto` finding GPUDirect Storage: `kvtier.transfer.handlers.file_path`).

Payloads sit at the slots' 4 KiB-aligned payload offsets (GDS with nvidia-fs, else kvikio's
compatibility mode). Stores checksum each block on the device and `FileBackend.direct_path
.commit_direct` them; loads read the headers, the payloads into a device buffer, verify there, and
scatter the blocks that verified (those that did not are forgotten by the tier and named by
`BlocksFailed`, their engine pages untouched). On CPU tensors it runs through kvikio's host path
(tests, with `tests.support.fake_cuda`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.core.errors import BlocksFailed
from kvtier.core.specs import GPULoadStoreSpec, LoadStoreSpec
from kvtier.tiers.file import fileio
from kvtier.tiers.file.checksum import tensor_checksum_async
from kvtier.tiers.file.fileio import ALIGN as _ALIGN
from kvtier.tiers.file.slot_format import CHECK_CRC32, CHECK_TORCH, payload_crc32
from kvtier.transfer.handlers.gpu_file import GPUFileHandler, _gpu_file_job, without_slots
from kvtier.transfer.handlers.kv_layout import KVLayout


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
