"""Slab I/O of the file tier: slot images moved between callers' buffers and `root_dir/slab.0`.

`SlabIO` owns the `BlockIO` (fileio.py) on the slab, a thread pool and a set of page-aligned
bounce buffers. The slots of one call are grouped into runs of adjacent slots of about
`RUN_BYTES`, one I/O each, run in parallel on the pool. A run goes zero-copy when it can (one
preadv/pwritev of header, payload, padding per slot, straight from the caller's buffers: posix
I/O, writable buffers, and with O_DIRECT page-aligned ones of whole 4 KiB pages), else through
a bounce buffer. Every slot read is verified (slot_format.py); a bad one is reported, never served.
A slab of blocks made of `parts` equal parts (`FileBackend(part_checks=)`) writes each slot's part
table with its header (the same one pass over the payload as its checksum).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.tiers.file.fileio import ALIGN, BlockIO, aligned_buffer, buffer_address
from kvtier.tiers.file.slot_format import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    SlotHeader,
    check_header,
    pack_header,
    part_crcs,
    payload_crc32,
    verify_parts,
    verify_slot,
)

log = logging.getLogger("kvtier.tiers.file")  # the file tier's one logger (documented in tiers/file/backend.py)

RUN_BYTES = 8 << 20  # adjacent slots are merged into I/Os of about this size (a whole number of slots)


def check_slots(slots, keys, num_slots: int) -> None:
    """ValueError unless `slots` are distinct slots of the slab, one per key, and every key fits
    a slot header."""
    if len(slots) != len(keys):
        raise ValueError(f"{len(slots)} slots and {len(keys)} keys: lengths must match")
    if len(set(slots)) != len(slots):
        raise ValueError(f"duplicate slots in {list(slots)}")
    for slot, key in zip(slots, keys):
        if not 0 <= slot < num_slots:
            raise ValueError(f"slot {slot} out of range 0..{num_slots - 1}")
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")


def block_views(slots, keys, buffers, num_slots: int, block_bytes: int, writable: bool) -> list[memoryview]:
    """Byte views of `buffers` after checking the arguments of a read or write (ValueError)."""
    if len(buffers) != len(slots):
        raise ValueError(f"{len(slots)} slots, {len(keys)} keys and {len(buffers)} buffers: lengths must match")
    check_slots(slots, keys, num_slots)
    views = []
    for buf in buffers:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError("buffers must be C-contiguous")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if view.nbytes != block_bytes:
            raise ValueError(f"buffer of {view.nbytes} bytes for a block of {block_bytes}")
        if writable and view.readonly:
            raise ValueError("read_blocks needs writable buffers")
        views.append(view)
    return views


class SlabIO:
    """Reads and writes of whole slots of one slab through a `BlockIO`. Safe to call from
    several threads at once for distinct slots."""

    def __init__(self, name: str, io: BlockIO, path: Path, block_bytes: int, slot_bytes: int, digest: bytes,
                 num_threads: int, parts: int = 1):
        """Take over `io` (open on `path`); slot headers are stamped with `digest` and, with `parts`
        > 1, carry the part table of that many parts."""
        self.name = name
        self.parts = parts
        self.io = io
        self.path = path
        self.block_bytes = block_bytes
        self.slot_bytes = slot_bytes
        self.digest = digest
        self._run_slots = max(1, round(RUN_BYTES / slot_bytes))
        self._buffers: queue.SimpleQueue = queue.SimpleQueue()
        pad = slot_bytes - HEADER_BYTES - block_bytes
        self._pad = memoryview(aligned_buffer(pad))[:pad] if pad else None  # written as is: contents unused
        self._pad_in = memoryview(aligned_buffer(pad))[:pad] if pad else None  # read into and ignored
        self._zero_copy_ok = io.vectored and (not io.direct or block_bytes % ALIGN == 0)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=f"kvtier-file-{name}")

    def write(self, slots: Sequence[int], keys: Sequence[bytes], views: list[memoryview]) -> dict[int, int]:
        """Write each `views[i]` as the block `keys[i]` into `slots[i]`; returns slot -> payload
        CRC. Waits for every run even when one fails (then raises its error)."""
        futures = [self._pool.submit(self._write_run, run, slots, keys, views) for run in self._runs(slots)]
        crcs: dict[int, int] = {}
        error = None
        for future in futures:  # wait for all: no write may still be in flight when we fail
            try:
                crcs.update(future.result())
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error
        return crcs

    def read(self, slots: Sequence[int], keys: Sequence[bytes],
             views: list[memoryview]) -> tuple[list[tuple[int, str]], Exception | None]:
        """Read and verify the blocks `keys[i]` in `slots[i]` into `views[i]`; returns the
        (slot, why) that failed verification (their views hold garbage) and the first I/O error
        met (None when there was none). Waits for every run."""
        futures = [self._pool.submit(self._read_run, run, slots, keys, views) for run in self._runs(slots)]
        bad: list[tuple[int, str]] = []
        error = None
        for future in futures:
            try:
                bad.extend(future.result())
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        return bad, error

    def write_headers(self, slots: Sequence[int], keys: Sequence[bytes], checks: Sequence[int], kind: int) -> None:
        """Write only the header pages of `slots`, whose payloads someone else wrote at
        `slot * slot_bytes + HEADER_BYTES` (the direct GPU path): one aligned 4 KiB write each."""
        pages = aligned_buffer(HEADER_BYTES * max(1, len(slots)))
        try:
            image = memoryview(pages)
            for i, (slot, key, check) in enumerate(zip(slots, keys, checks)):
                page = image[i * HEADER_BYTES:(i + 1) * HEADER_BYTES]
                pack_header(page, bytes(key), self.block_bytes, check, self.digest, kind)
                self.io.pwrite(slot * self.slot_bytes, page)
            del page, image
        finally:
            pages.close()

    def read_headers(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[SlotHeader | str]:
        """The header of each slot if it may describe the block `keys[i]` of this manifest (its
        payload not checked: the caller verifies it where it reads it), else why not."""
        pages = aligned_buffer(HEADER_BYTES)
        found: list[SlotHeader | str] = []
        try:
            page = memoryview(pages)
            for slot, key in zip(slots, keys):
                try:
                    self.io.pread(slot * self.slot_bytes, page)
                except OSError:
                    if os.stat(self.path).st_size < (slot + 1) * self.slot_bytes:
                        found.append("slab truncated")
                        continue
                    raise
                found.append(check_header(page, bytes(key), self.block_bytes, self.digest))
            del page
        finally:
            pages.close()
        return found

    def sync(self) -> None:
        """Make every completed write durable (fdatasync)."""
        self.io.sync()

    def drain(self) -> None:
        """Wait for the I/O in flight; no new call may start."""
        self._pool.shutdown(wait=True)

    def close(self) -> None:
        """`drain`, then close the `BlockIO` and free the bounce buffers. Idempotent."""
        self.drain()
        self.io.close()
        while not self._buffers.empty():
            try:
                self._buffers.get_nowait().close()
            except BufferError:  # still exported by a traceback's frame; freed with it
                pass

    # ------------------------------------------------------------------ runs
    def _runs(self, slots: Sequence[int]) -> list[list[int]]:
        """Positions into `slots`, grouped into runs of adjacent slots of at most RUN_BYTES."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        runs: list[list[int]] = []
        for pos in order:
            run = runs[-1] if runs else None
            if run and slots[run[-1]] + 1 == slots[pos] and len(run) < self._run_slots:
                run.append(pos)
            else:
                runs.append([pos])
        return runs

    def _take_buffer(self):
        try:
            return self._buffers.get_nowait()
        except queue.Empty:
            return aligned_buffer(self._run_slots * self.slot_bytes)

    def _zero_copy(self, run: list[int], views) -> bool:
        """Whether this run can go straight between the caller's buffers and the file (one
        preadv/pwritev of header, payload, padding per slot): posix I/O, writable buffers, and
        with O_DIRECT page-aligned ones of whole 4 KiB pages (the shared-memory CPU tier's slots)."""
        if not self._zero_copy_ok:
            return False
        if not self.io.direct:
            return True
        return all(not views[p].readonly and buffer_address(views[p]) % ALIGN == 0 for p in run)

    def _no_zero_copy(self, exc: OSError) -> None:
        if self._zero_copy_ok:
            self._zero_copy_ok = False
            log.warning("file tier %s: scatter-gather O_DIRECT refused (%s); copying through bounce buffers",
                        self.name, exc)

    def _write_run(self, run: list[int], slots, keys, views) -> dict[int, int]:
        """Runs on the pool: write one run of adjacent slots (zero-copy or via a bounce buffer)."""
        buf = self._take_buffer()
        try:
            image = memoryview(buf)
            if self._zero_copy(run, views):
                crcs = self._write_run_direct(run, slots, keys, views, image)
                if crcs is not None:
                    return crcs
            crcs = {}
            for i, pos in enumerate(run):
                base = i * self.slot_bytes
                payload = image[base + HEADER_BYTES:base + HEADER_BYTES + self.block_bytes]
                payload[:] = views[pos]
                crcs[slots[pos]] = self._pack(image[base:base + HEADER_BYTES], keys[pos], payload)
            self.io.pwrite(slots[run[0]] * self.slot_bytes, image[:len(run) * self.slot_bytes])
            return crcs
        finally:
            self._buffers.put(buf)

    def _pack(self, header, key: bytes, payload) -> int:
        """Write the header page of the block `key` whose payload is `payload`; its CRC-32."""
        if self.parts > 1:
            parts = part_crcs(payload, self.parts)
            pack_header(header, key, self.block_bytes, parts[-1], self.digest, parts=parts)
            return parts[-1]
        crc = payload_crc32(payload)
        pack_header(header, key, self.block_bytes, crc, self.digest)
        return crc

    def _write_run_direct(self, run: list[int], slots, keys, views, image) -> dict[int, int] | None:
        """The zero-copy write of a run (headers built in `image`); None when the `BlockIO` refused
        the scatter-gather I/O (EINVAL: e.g. a 4 KiB-sector device refuses 512-byte iovecs)."""
        crcs = {}
        iovs = []
        for i, pos in enumerate(run):
            header = image[i * HEADER_BYTES:(i + 1) * HEADER_BYTES]
            crcs[slots[pos]] = self._pack(header, keys[pos], views[pos])
            iovs += [header, views[pos], self._pad] if self._pad else [header, views[pos]]
        try:
            self.io.pwritev(slots[run[0]] * self.slot_bytes, iovs)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._no_zero_copy(exc)
            return None
        return crcs

    def _read_run(self, run: list[int], slots, keys, views) -> list[tuple[int, str]]:
        """Runs on the pool: read one run, verify each slot; a bad slot's buffer holds garbage and
        is reported (never served). Zero-copy when possible, else via a bounce buffer."""
        buf = self._take_buffer()
        try:
            image = memoryview(buf)
            offset, length = slots[run[0]] * self.slot_bytes, len(run) * self.slot_bytes
            if self._zero_copy(run, views):
                bad = self._read_run_direct(run, slots, keys, views, image)
                if bad is not None:
                    return bad
            try:
                self.io.pread(offset, image[:length])
            except OSError as exc:
                return self._read_cut_run(run, slots, keys, views, exc)
            bad = []
            for i, pos in enumerate(run):
                slot_view = image[i * self.slot_bytes:(i + 1) * self.slot_bytes]
                why = verify_slot(slot_view, bytes(keys[pos]), self.block_bytes, self.digest)
                if why is None:
                    views[pos][:] = slot_view[HEADER_BYTES:HEADER_BYTES + self.block_bytes]
                else:
                    bad.append((slots[pos], why))
            return bad
        finally:
            self._buffers.put(buf)

    def _read_cut_run(self, run: list[int], slots, keys, views, error: OSError) -> list[tuple[int, str]]:
        """A run whose read failed with `error`: when the slab ends inside it (cut), its slots past
        the end are bad ("slab truncated", each alone) and the others are read again; otherwise
        `error` stands."""
        size = os.stat(self.path).st_size
        inside = [p for p in run if (slots[p] + 1) * self.slot_bytes <= size]  # (a prefix: the run is ascending)
        if len(inside) == len(run):
            raise error
        cut = [(slots[p], "slab truncated") for p in run[len(inside):]]
        return cut + (self._read_run(inside, slots, keys, views) if inside else [])

    def _read_run_direct(self, run: list[int], slots, keys, views, image) -> list[tuple[int, str]] | None:
        """The zero-copy read of a run (headers into `image`); None when the `BlockIO` refused the
        scatter-gather I/O (EINVAL)."""
        offset = slots[run[0]] * self.slot_bytes
        headers = [image[i * HEADER_BYTES:(i + 1) * HEADER_BYTES] for i in range(len(run))]
        iovs = []
        for header, pos in zip(headers, run):
            iovs += [header, views[pos], self._pad_in] if self._pad else [header, views[pos]]
        try:
            self.io.preadv(offset, iovs)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                self._no_zero_copy(exc)
                return None
            return self._read_cut_run(run, slots, keys, views, exc)
        return [(slots[pos], why) for header, pos in zip(headers, run)
                if (why := verify_parts(header, views[pos], bytes(keys[pos]), self.block_bytes,
                                        self.digest)) is not None]
