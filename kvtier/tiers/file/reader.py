"""`SlabReader`: a file tier read, read-only, by a process that does not own it.

The scheduler's `FileBackend` owns a tier: its lock, index, journal, pins and every write. A vLLM
worker process that loads file-tier blocks straight into its KV cache reads the same slab through
a `SlabReader`, which

- takes `root_dir` and the identity it expects from its own copy of the configuration (the spec
  is built from the same trusted config in every process), never from what the scheduler sends:
  a load names slots, keys and the identity of the tier's manifest, no path;
- checks `root_dir` as the tier's own opening does, changing nothing (`rootdir.inspect_root`: no
  symlink of another user on the way, a directory of yours not writable by group/others, the
  tier's files regular, single-linked, yours, not group/other-writable), then opens the directory
  (`O_NOFOLLOW`) and, in it, the manifest and the slab `O_RDONLY | O_NOFOLLOW` (`O_DIRECT` where
  the filesystem takes it), and checks each descriptor again (fstat: `check_file`);
- refuses a manifest other than the one its configuration derives (format version, geometry,
  fingerprint, layout: `manifest_differences`, the identity rules of the tier's opening), and a
  load whose identity (the scheduler's manifest digest, epoch included) is another
  (`check_identity`);
- holds read-only descriptors only: it never takes the tier's lock, writes, truncates, extends,
  chmods or unlinks anything, and never reads past the slots of the manifest's geometry;
- reads of each slot the header page and the bytes it owns, `part` = (r, n): bytes
  `[r * P, (r + 1) * P)` of the payload, `P` = block_bytes / n (a tensor-parallel rank's part; (0,
  1) the whole block), verifies the header (magic, version, manifest digest, key, length, header
  CRC) and exactly those bytes against the slot's part table (`slot_format.verify_part`); a slot
  without a table of n parts (written before part checksums, or by the GPU direct path) is read
  whole and verified by its payload checksum, then its part used. A reader of (0, 1) verifies the
  payload checksum, of either kind;
- reports blocks that fail verification (`IntegrityError` naming their slots) without forgetting
  them: only the owner changes the index, and the scheduler drops them when the load completes as
  failed (`HierarchyManager.complete_load(failed=...)`).

A slot stays its block's while a reader reads it: the scheduler pins a block at `prepare_load` and
releases the pin at `complete_load`, after the worker reported the job; a pinned block is never
evicted, so its slot is neither reallocated nor rewritten meanwhile.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.core.errors import IntegrityError, KVTierError
from kvtier.tiers.file.fileio import ALIGN, PosixIO, aligned_buffer, buffer_address
from kvtier.tiers.file.manifest import load_manifest, manifest_differences, manifest_digest
from kvtier.tiers.file.rootdir import SLAB, check_directory, check_file, expand_root_dir, inspect_root, refuse
from kvtier.tiers.file.slab import block_views
from kvtier.tiers.file.slot_format import HEADER_BYTES, SlotHeader, check_header, payload_check, verify_part

log = logging.getLogger("kvtier.tiers.file")  # the file tier's one logger (documented in tiers/file/backend.py)


class ReadOnlyIO(PosixIO):
    """`PosixIO` over a descriptor opened `O_RDONLY` (the kernel refuses any write on it); its
    write calls refuse before they reach it."""

    def __init__(self, fd: int, direct: bool):  # (no super().__init__: it opens the file read-write)
        self.fd, self.direct, self._closed = fd, direct, False

    def pwrite(self, offset: int, buf) -> None:
        raise PermissionError(errno.EBADF, "a SlabReader never writes")

    def pwritev(self, offset: int, iovs: list) -> None:
        raise PermissionError(errno.EBADF, "a SlabReader never writes")

    def sync(self) -> None:
        raise PermissionError(errno.EBADF, "a SlabReader never writes")


def _open_dir(root_dir: str) -> tuple[Path, int]:
    """`root_dir` resolved and checked (`inspect_root`), and a descriptor of it; `ConfigError` on
    `root_dir` where the tier's opening would refuse it, or where it does not exist."""
    root = expand_root_dir(root_dir)
    inspect_root(root)
    resolved = Path(os.path.realpath(os.path.join(os.getcwd(), root)))
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise refuse(f"{root}: the file tier's directory cannot be opened for reading ({exc.strerror}); its "
                     f"scheduler creates it when the engine starts") from exc
    try:
        check_directory(os.fstat(fd), root, resolved)
    except BaseException:
        os.close(fd)
        raise
    return resolved, fd


def _open_slab(root: Path, dir_fd: int, name: str) -> ReadOnlyIO:
    """The slab, read-only, `O_DIRECT` when a 4 KiB probe read takes it (else buffered, one warning)."""
    path = root / SLAB
    for direct in (True, False):
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            fd = os.open(SLAB, flags, dir_fd=dir_fd)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                continue
            if exc.errno == errno.ELOOP:
                check_file(path, os.stat(SLAB, dir_fd=dir_fd, follow_symlinks=False), dir_fd)
            raise
        try:
            check_file(path, os.fstat(fd))
            if direct and not _takes_direct(fd):
                os.close(fd)
                log.warning("file tier %s: O_DIRECT reads refused on %s; this reader reads through the page cache",
                            name, path)
                continue
        except BaseException:
            os.close(fd)
            raise
        return ReadOnlyIO(fd, direct and bool(getattr(os, "O_DIRECT", 0)))
    raise AssertionError("unreachable: the buffered open returns or raises")


def _takes_direct(fd: int) -> bool:
    probe = aligned_buffer(ALIGN)
    try:
        os.preadv(fd, [probe], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        probe.close()


class SlabReader:
    """One file tier's slab, read-only, from a process that does not own the tier (module
    docstring). `block_bytes` is what `read_blocks` moves per slot: this reader's part."""

    def __init__(self, name: str, root_dir: str, wanted: dict, part: tuple[int, int] = (0, 1), num_threads: int = 4):
        """Open the tier `name` whose manifest must be `wanted` (`manifest.wanted_manifest`: what
        this process's configuration derives; its epoch is the owner's), reading part `part`."""
        index, count = part
        whole = int(wanted["block_bytes"])
        if not (0 <= index < count and whole % count == 0):
            raise ValueError(f"part {index} of {count}: blocks of {whole} bytes are not cut so")
        self.name, self.part, self.num_threads = name, (index, count), num_threads
        self.whole_bytes, self.block_bytes = whole, whole // count
        self.slot_bytes, self.num_slots = int(wanted["slot_bytes"]), int(wanted["num_slots"])
        self.root, dir_fd = _open_dir(root_dir)
        try:
            found, unreadable = load_manifest(self.root, dir_fd)
            diffs = [f"no readable manifest: {unreadable}"] if unreadable else manifest_differences(found, wanted)
            if diffs:
                raise KVTierError(f"file tier {name}: {self.root} does not hold the tier this process's configuration "
                                  f"describes ({'; '.join(diffs)}); a worker reads only the tier its scheduler opened")
            assert found is not None  # (no differences: a manifest was read)
            self.digest = manifest_digest(found)
            self.slab_path = self.root / SLAB
            self.io = _open_slab(self.root, dir_fd, name)
        finally:
            os.close(dir_fd)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"kvtier-read-{name}")
        self._local = threading.local()

    def check_identity(self, identity: bytes | None) -> None:
        """`KVTierError` unless `identity` (a load's: the scheduler's manifest digest) is this tier's."""
        if identity is not None and bytes(identity) != self.digest:
            raise KVTierError(f"file tier {self.name}: a load names tier identity {bytes(identity).hex()}, the "
                              f"manifest in {self.root} is {self.digest.hex()}: the scheduler's tier is not the "
                              f"one this process opened (its root_dir differs, or the tier was rebuilt)")

    def read_blocks(self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence) -> int:
        """Read and verify this reader's part of the blocks `keys[i]` in `slots[i]` into the
        writable `buffers[i]` (`block_bytes` each). Those that fail verification raise one
        `IntegrityError` naming their slots (the others were read and verified; nothing is
        forgotten here); an I/O error raises itself."""
        views = block_views(slots, keys, buffers, self.num_slots, self.block_bytes, writable=True)
        futures = [self._pool.submit(self._read_one, s, bytes(k), v) for s, k, v in zip(slots, keys, views)]
        bad, error = [], None
        for slot, future in zip(slots, futures):
            try:
                why = future.result()
            except OSError as exc:
                error = error or exc
                continue
            if why is not None:
                bad.append((slot, why))
        if error is not None:
            raise error
        if bad:
            detail = "; ".join(f"slot {s}: {why}" for s, why in bad[:8])
            raise IntegrityError(f"file tier {self.name}: {len(bad)} block(s) in {self.slab_path} failed verification "
                                 f"and will not be served ({detail})", [s for s, _ in bad])
        return len(slots) * self.block_bytes

    def close(self) -> None:
        """Wait for the reads in flight, close the slab. Idempotent."""
        self._pool.shutdown(wait=True)
        self.io.close()

    # ------------------------------------------------------------------ one slot
    def _read_one(self, slot: int, key: bytes, view: memoryview) -> str | None:
        """Read and verify this reader's part of `slot` into `view`; None, or why it failed."""
        index, count = self.part
        base = slot * self.slot_bytes
        at = base + HEADER_BYTES + index * self.block_bytes
        page = self._buffer("page", HEADER_BYTES)
        straight = self._straight(view, at)
        if not self._fill(base, [page, view] if straight and index == 0 else [page]):
            return "slab truncated"
        if not (straight and index == 0) and not self._fill(at, [view], straight):
            return "slab truncated"
        header = check_header(page, key, self.whole_bytes, self.digest)
        if isinstance(header, str):
            return header
        if count == 1:
            return None if payload_check(header.check_kind, view) == header.payload_crc else "payload checksum mismatch"
        if len(header.parts) == count:
            return verify_part(header, view, index)
        return self._whole(base, header, view)

    def _whole(self, base: int, header: SlotHeader, view: memoryview) -> str | None:
        """A slot without a part table of this reader's count: its whole payload, verified by its
        payload checksum, this reader's part then copied into `view`."""
        whole = self._buffer("whole", self.whole_bytes)
        if not self._fill(base + HEADER_BYTES, [whole], self._straight(whole, base + HEADER_BYTES)):
            return "slab truncated"
        if payload_check(header.check_kind, whole) != header.payload_crc:
            return "payload checksum mismatch"
        start = self.part[0] * self.block_bytes
        view[:] = whole[start:start + self.block_bytes]
        return None

    def _straight(self, view: memoryview, offset: int) -> bool:
        """Whether `view` can be read into at `offset` as it is (always, buffered; with O_DIRECT
        when the offset, its length and its address are 4 KiB-aligned)."""
        if not self.io.direct:
            return True
        return offset % ALIGN == 0 and len(view) % ALIGN == 0 and buffer_address(view) % ALIGN == 0

    def _fill(self, offset: int, views: list[memoryview], straight: bool = True) -> bool:
        """Fill `views`, in order, from `offset`: straight, or (one view) through the aligned
        window around it; False when the slab ends first (truncated), an I/O error raises."""
        lo, hi = offset, offset + sum(len(v) for v in views)
        if not straight:
            lo, hi = offset // ALIGN * ALIGN, -(-hi // ALIGN) * ALIGN
        try:
            if straight:
                self.io.preadv(offset, views)
                return True
            bounce = self._buffer("bounce", hi - lo)
            self.io.pread(lo, bounce)
        except OSError:
            if os.fstat(self.io.fd).st_size < hi:
                return False
            raise
        views[0][:] = bounce[offset - lo:offset - lo + len(views[0])]
        return True

    def _buffer(self, kind: str, nbytes: int) -> memoryview:
        """This thread's page-aligned buffer `kind` of at least `nbytes` (kept for its next reads)."""
        held = getattr(self._local, kind, None)
        if held is None or len(held) < nbytes:
            held = memoryview(aligned_buffer(nbytes))
            setattr(self._local, kind, held)
        return held[:nbytes]
