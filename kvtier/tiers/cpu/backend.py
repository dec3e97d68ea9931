"""`CPUBackend`: the CPU tier as one shared-memory region (a file in /dev/shm).

Layout: one header page, then slot `i` at byte `header_bytes + i * slot_stride`, where `slot_stride`
is `block_bytes` rounded up to the OS page size; the first `block_bytes` bytes of a slot hold one
block, the rest is padding. The region is exactly `header_bytes + num_blocks * slot_stride` bytes.
The header names the region's creator (pid), a random per-region token and the geometry: an
attaching process checks them, so it maps only the region it was told to map.

Ownership. The creating process holds a shared flock on the region for its whole life (the kernel
drops it however the process dies), so "its lock can be taken" means "its owner is dead". The
region is built under a temporary name, locked and given its header, then published under its
name with `link` (which never replaces an existing file): every published region is locked from
its first instant. A name held by a live owner is refused (`RegionInUseError`, with the owner's
pid); a name left by a dead owner is reclaimed; a file that is not a kvtier region is never touched.

The claim. The region's name may be removed long before its owner ends (see Lifetime), so the name
itself is held by a second, tiny file: `<shm_name>.kvtier-claim` (a suffix no shm_name may end
with), which holds the owner's pid and stays exclusively flocked, published the same way, for the
creator's whole life. A new region takes the claim first: a claim whose lock is held refuses the
name (`RegionInUseError`, "region <name> in use by pid N"), even when the region's own name is
already gone; a claim whose owner died is reclaimed at once.

Lifetime. The creator removes the name and the claim on `close`, at exit, and on SIGTERM/SIGHUP (a
handler that then chains to the previous one). The region's name is needed only until every
process that maps the region has mapped it: `unpublish()` removes it early (the vLLM integration
does, once its worker has mapped the region), so no kill, not even SIGKILL, can leak the region
afterwards; a SIGKILL leaves at most the claim (a few bytes). Regions and claims of owners that
died are removed by `remove_stale_regions`, which every new region runs first.

Other processes (vLLM workers) map the same bytes with `CPUBackend.attach(shm_name, num_blocks,
block_bytes, token=...)`. When CUDA is available (and `pin` allows it) each process registers its
mapping with `cudaHostRegister`, so GPU copies to and from it run as DMA without a bounce buffer.
Pinning initialises CUDA in the process: a process that never touches the GPU (vLLM's scheduler)
should pass `pin=false`.

Making the region ready is `ftruncate` + `mmap` (pages are faulted in by the kernel on first touch,
or all at once by `cudaHostRegister` when pinning), never a Python loop over pages.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import weakref
from collections.abc import Mapping
from typing import Any

from kvtier.core.errors import KVTierError
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.tiers import room
from kvtier.tiers.base import HOST_HANDLERS, Backend
from kvtier.tiers.cpu.pinning import cuda_available, register, unregister
from kvtier.tiers.cpu.shm_names import (
    _HEADER,
    _MAGIC,
    _PUBLISHED,
    _TMP_PREFIX,
    CLAIM_SUFFIX,
    HEADER_BYTES,
    _free_region_name,
    _install_terminate_handlers,
    _link_exclusively,
    _new_locked_file,
    _read_header,
    _remove_names_of_creator,
    _take_claim,
    _unlink_if_same,
    _unlink_quietly,
    region_in_use,
)
from kvtier.tiers.cpu.shm_names import SHM_DIR as SHM_DIR  # tests point cpu.SHM_DIR at a private directory
from kvtier.tiers.cpu.shm_names import RegionHeader as RegionHeader  # re-exported: part of this module's API
from kvtier.tiers.cpu.shm_names import RegionInUseError as RegionInUseError
from kvtier.tiers.cpu.shm_names import remove_stale_regions as remove_stale_regions

log = logging.getLogger(__name__)

# cudaHostRegister is called on chunks of at most this many bytes (drivers limit one registration).

_NAME_MAX = 255 - len(CLAIM_SUFFIX)  # a claim's name must fit in one file name (Linux NAME_MAX 255)
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class RegionError(KVTierError, ValueError):
    """A shared-memory region is not the one expected (not a kvtier region, other geometry or token)."""


def _shm_name(v: Any) -> str | None:
    if v is None:
        return None
    shown = repr(v[:40]) + ("..." if len(v) > 40 else "") if isinstance(v, str) else repr(v)[:60]
    if (not isinstance(v, str) or not _NAME_RE.fullmatch(v) or len(v) > _NAME_MAX
            or v.startswith(_TMP_PREFIX) or v.endswith(CLAIM_SUFFIX)):
        raise ValueError(f"expected a file name for {SHM_DIR}: 1 to {_NAME_MAX} characters from A-Z a-z 0-9 "
                         f"'_' '.' '-', not starting with '.', '-' or {_TMP_PREFIX!r}, not ending with "
                         f"{CLAIM_SUFFIX!r}; got {shown}")
    return v


def _pin_mode(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v not in ("auto", "true", "false"):
        raise ValueError(f"{v!r} is not one of auto, true, false")
    return v


# path -> the live region this process created there: attach() in the same process maps it
# through the creator's file descriptor, so it needs no name (and cannot map another's region).
_OWNED: weakref.WeakValueDictionary[str, CPUBackend] = weakref.WeakValueDictionary()


class CPUBackend(Backend):
    """Blocks in a shared-memory region; `view(slot)` and `tensor()` expose them without copies."""

    spec_type = CPULoadStoreSpec
    medium = "CPU"
    handlers = HOST_HANDLERS  # (max_blocks stays None: memory and /dev/shm bound it, capacity_problem)

    OPTIONS = {
        "shm_name": (None, _shm_name),  # file name in /dev/shm; default: generated, unique
        "pin": ("auto", _pin_mode),  # auto: cudaHostRegister when CUDA is available
    }

    @classmethod
    def capacity_problem(cls, need_bytes: int, options: Mapping[str, Any]) -> str | None:
        """The region must fit in the available memory and in the free space of `SHM_DIR`."""
        return room.memory_problem(need_bytes, SHM_DIR)

    @classmethod
    def check_environment(cls, options: dict) -> tuple[list[str], list[tuple[str, str]]]:
        """`pin: true` needs CUDA here; a given `shm_name` must not be a region in use."""
        problems = []
        if _pin_mode(options.get("pin", "auto")) == "true" and not cuda_available():
            problems.append(("pin", "true, but CUDA is not available here: use pin: auto, which pins where CUDA is"))
        if options.get("shm_name") and (in_use := region_in_use(options["shm_name"], SHM_DIR)):
            problems.append(("shm_name", in_use))
        return [], problems

    def __init__(self, name: str, num_blocks: int, block_bytes: int, block_size: int = 0,
                 shm_name: str | None = None, pin: str | bool = "auto", *, _create: bool = True,
                 _token: str | None = None):
        super().__init__(name, num_blocks, block_bytes, block_size)
        if block_bytes <= 0:
            raise ValueError(f"CPUBackend {name!r} needs block_bytes > 0, got {block_bytes}")
        pin = _pin_mode(pin)
        self.shm_name = _shm_name(shm_name) or f"kvtier-{os.getpid()}-{secrets.token_hex(4)}-{name}"
        self.path = os.path.join(SHM_DIR, self.shm_name)
        page = mmap.PAGESIZE
        self.header_bytes = HEADER_BYTES
        self.slot_stride = -(-block_bytes // page) * page
        self.size = num_blocks * self.slot_stride  # bytes of the slots (the header page not counted)
        self.owner = _create
        self._tensor = None
        self._pinned: list[int] = []  # registered chunk addresses
        self._closed = False
        self._lock_fd = -1
        self._claim_fd = -1
        self._finalizer: weakref.finalize | None = None
        if _create:
            self.token = secrets.token_hex(16)
            fd = self._create_region()
        else:
            fd = self._open_region(_token)
        try:
            self._mmap = mmap.mmap(fd, self.header_bytes + self.size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if self._finalizer is not None:
                self._finalizer()
            os.close(fd)
            self._close_claim()
            raise
        if _create:
            self._lock_fd = fd  # keeps the flock: tells everyone that the owner is alive
            _OWNED[self.path] = self
        else:
            os.close(fd)  # the mapping keeps the file alive
        self._view = memoryview(self._mmap)
        self.pinned = False
        if pin == "true" or (pin == "auto" and cuda_available()):
            try:
                self._pinned = register(self.name, self.data_ptr(), self.size, self.slot_stride, pin == "true")
            except BaseException:
                self.close()  # a failed build leaves no region behind
                raise
        self.pinned = bool(self._pinned)

    @classmethod
    def attach(cls, shm_name: str, num_blocks: int, block_bytes: int, block_size: int = 0,
               name: str = "cpu", pin: str | bool = "auto", token: str | None = None) -> CPUBackend:
        """Map a region created by another process or object (same geometry). With `token` (the
        creator's `token`), only that very region is mapped; another one under the same name is
        refused with `RegionError`. A region this process created is mapped through its creator's
        descriptor, even after `unpublish`. `close` leaves the file in place."""
        return cls(name, num_blocks, block_bytes, block_size, shm_name=shm_name, pin=pin, _create=False,
                   _token=token)

    # ------------------------------------------------------------------ creation and attach
    def _create_region(self) -> int:
        """Take the name's claim, build the region under a temporary name (locked, sized, with its
        header), then publish it under `path` with link(2): a name claimed by a live owner is
        refused, an existing region is never replaced, nor reused."""
        directory = os.path.dirname(self.path)
        remove_stale_regions(directory)
        self._claim_fd, claim_ident = _take_claim(self.path)
        claim = (self.path + CLAIM_SUFFIX, claim_ident)
        try:
            fd, st = self._publish_region(directory)
        except BaseException:
            _unlink_if_same(*claim)
            self._close_claim()
            raise
        self._ident = (st.st_dev, st.st_ino)
        _PUBLISHED[self.path] = self._ident
        # the region's name goes before its claim: the name is never free while its region is there
        self._finalizer = weakref.finalize(self, _remove_names_of_creator, os.getpid(), (self.path, self._ident),
                                           claim)
        _install_terminate_handlers()
        return fd

    def _publish_region(self, directory: str) -> tuple[int, os.stat_result]:
        """Build the region under a temporary name (its shared lock held for its life, its header,
        its size), then publish it under `path`: (descriptor, stat)."""
        header = _HEADER.pack(_MAGIC, os.getpid(), bytes.fromhex(self.token), self.num_blocks, self.slot_stride,
                              self.block_bytes)
        fd, tmp = _new_locked_file(directory, fcntl.LOCK_SH, header)
        try:
            os.ftruncate(fd, self.header_bytes + self.size)
            _link_exclusively(tmp, self.path, _free_region_name)
            return fd, os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        finally:
            _unlink_quietly(tmp)

    def _close_claim(self) -> None:
        if self._claim_fd >= 0:
            os.close(self._claim_fd)
            self._claim_fd = -1

    def _open_region(self, token: str | None) -> int:
        """Open the region to attach and check that it is the one expected; returns its descriptor."""
        owner = _OWNED.get(self.path)
        if owner is not None and owner._lock_fd >= 0:
            fd = os.dup(owner._lock_fd)
        else:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            self._ident = (st.st_dev, st.st_ino)
            self.token = self._check_region(fd, st, token)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_region(self, fd: int, st: os.stat_result, token: str | None) -> str:
        header = _read_header(fd) if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() else None
        if header is None:
            raise RegionError(f"{self.path} is not a kvtier region of this user")
        if token is not None and not secrets.compare_digest(header.token, token):
            raise RegionError(f"region {self.shm_name} (created by pid {header.pid}) is not the one this process "
                              f"was told to map (token mismatch): another kvtier instance uses the same shm_name")
        expected = (self.num_blocks, self.slot_stride, self.block_bytes)
        actual = (header.num_blocks, header.slot_stride, header.block_bytes)
        if actual != expected or st.st_size != self.header_bytes + self.size:
            raise RegionError(f"shared region {self.path} holds {header.num_blocks} slots of {header.block_bytes} "
                              f"bytes ({st.st_size} bytes), expected {self.num_blocks} slots of {self.block_bytes} "
                              f"bytes ({self.header_bytes + self.size} bytes)")
        return header.token

    def unpublish(self) -> None:
        """Remove the region's name from /dev/shm, once every process that maps it has mapped it.

        The bytes stay mapped wherever they are mapped, and are freed by the kernel when the last
        mapping goes, however its process ends: nothing can leak any more. Nobody can attach the
        region by name afterwards (this process still can: see `attach`). Idempotent; safe from
        an attached process (only this region's name is removed, never a newer region's)."""
        _unlink_if_same(self.path, self._ident)

    def owner_pid(self) -> int:
        """Pid of the process that created the region (from its header)."""
        return _HEADER.unpack_from(self._mmap, 0)[1]

    # ------------------------------------------------------------------ bytes
    def view(self, slot: int) -> memoryview:
        """The `block_bytes` bytes of one slot (writable; valid until `close`)."""
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"slot {slot} out of range 0..{self.num_blocks - 1}")
        start = self.header_bytes + slot * self.slot_stride
        return self._view[start:start + self.block_bytes]

    def tensor(self):
        """A uint8 tensor `(num_blocks, block_bytes)` over the slots (row stride `slot_stride`), no copy.
        Its storage is exactly the slots' `size` bytes, starting at slot 0."""
        if self._tensor is None:
            import torch

            flat = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=self.header_bytes, count=self.size)
            self._tensor = flat.as_strided((self.num_blocks, self.block_bytes), (self.slot_stride, 1))
        return self._tensor

    def data_ptr(self) -> int:
        """Address of slot 0 in this process (page-aligned)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self._mmap, self.header_bytes))

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Unpin and unmap; the creating process also removes the name (if still its region's) and
        the claim, and releases their locks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        unregister(self._pinned)
        self._tensor = None
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view or tensor of the region: the mapping goes when they do.
            log.debug("CPUBackend %r: region still referenced; unmapped when released", self.name)
        if self._finalizer is not None:
            self._finalizer()
        if self._lock_fd >= 0:
            if _OWNED.get(self.path) is self:
                del _OWNED[self.path]
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._close_claim()

    def __repr__(self) -> str:
        return (f"CPUBackend({self.name!r}, {self.num_blocks} x {self.block_bytes} B, shm={self.shm_name!r}, "
                f"pinned={self.pinned})")
