"""`CPUBackend`: the CPU tier as one shared-memory region (a file in /dev/shm).

Layout: slot `i` starts at byte `i * slot_stride`, where `slot_stride` is `block_bytes` rounded up to
the OS page size; the first `block_bytes` bytes of a slot hold one block, the rest is padding.
The region is exactly `num_blocks * slot_stride` bytes (no rounding of the capacity, no second copy).

The creating process owns the file (mode 0600) and removes it on `close`; other processes (vLLM
workers) map the same bytes with `CPUBackend.attach(shm_name, num_blocks, block_bytes)`. When CUDA
is available (and `pin` allows it) each process registers its mapping with `cudaHostRegister`, so
GPU copies to and from it run as DMA without a bounce buffer. Pinning initialises CUDA in the
process: a process that never touches the GPU (vLLM's scheduler) should pass `pin=false`.

Making the region ready is `ftruncate` + `mmap` (pages are faulted in by the kernel on first touch,
or all at once by `cudaHostRegister` when pinning), never a Python loop over pages.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import time
import weakref
from typing import Any

from kvtier.specs import CPULoadStoreSpec
from kvtier.tiers.base import Backend

log = logging.getLogger("kvtier.tiers.cpu")

SHM_DIR = "/dev/shm"
# cudaHostRegister is called on chunks of at most this many bytes (drivers limit one registration).
_MAX_REGISTER_BYTES = 16 << 30
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


def _shm_name(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v or "/" in v or v in (".", "..") or len(v) > 200:
        raise ValueError(f"expected a file name for /dev/shm (no '/'), got {v!r}")
    return v


def _pin_mode(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v not in ("auto", "true", "false"):
        raise ValueError(f"{v!r} is not one of auto, true, false")
    return v


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: exists, another user's
        return True
    return True


def remove_stale_regions(shm_dir: str = SHM_DIR, min_age_s: float = 10.0) -> list[str]:
    """Remove the regions (`kvtier-*` files) whose creating process is gone, and return their names.

    A creating process holds a shared flock on its region for its whole life (the kernel drops it
    when the process dies, however it dies), so a region on which an exclusive flock can be taken
    has no owner left; the pid in a generated name (`kvtier-<pid>-...`) must also be gone (regions
    of kvtier versions that took no lock). A SIGKILLed owner cannot unlink its region itself:
    without this sweep each kill leaves the full size of its CPU tier in /dev/shm until reboot.
    Files of other users, regions still locked and regions younger than `min_age_s` are left alone.
    """
    removed = []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith("kvtier-")]
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        pid = name.split("-")[1]
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            # not someone else's, and not one being created right now (open and flock are two calls)
            if st.st_uid != uid or time.time() - st.st_ctime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # an owner is alive
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d shared-memory region(s) left in %s by processes that died: %s", len(removed),
                    shm_dir, ", ".join(removed[:5]))
    return removed


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed registration, so that a later, unrelated
    launch check does not report it. Best effort: torch does not bind cudaGetLastError."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


class CPUBackend(Backend):
    """Blocks in a shared-memory region; `view(slot)` and `tensor()` expose them without copies."""

    spec_type = CPULoadStoreSpec
    medium = "CPU"

    OPTIONS = {
        "shm_name": (None, _shm_name),  # file name in /dev/shm; default: generated, unique
        "pin": ("auto", _pin_mode),  # auto: cudaHostRegister when CUDA is available
    }

    def __init__(self, name: str, num_blocks: int, block_bytes: int, block_size: int = 0,
                 shm_name: str | None = None, pin: str | bool = "auto", *, _create: bool = True):
        super().__init__(name, num_blocks, block_bytes, block_size)
        if block_bytes <= 0:
            raise ValueError(f"CPUBackend {name!r} needs block_bytes > 0, got {block_bytes}")
        pin = _pin_mode(pin)
        self.shm_name = _shm_name(shm_name) or f"kvtier-{os.getpid()}-{secrets.token_hex(4)}-{name}"
        self.path = os.path.join(SHM_DIR, self.shm_name)
        page = mmap.PAGESIZE
        self.slot_stride = -(-block_bytes // page) * page
        self.size = num_blocks * self.slot_stride
        self.owner = _create
        self._tensor = None
        self._pinned: list[int] = []  # registered chunk addresses
        self._closed = False
        self._lock_fd = -1
        if _create:
            remove_stale_regions(os.path.dirname(self.path))
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            # held for the region's life: tells remove_stale_regions that its owner is alive
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)
        else:
            fd = os.open(self.path, os.O_RDWR)
            self._finalizer = None
        try:
            if _create:
                os.ftruncate(fd, self.size)
            else:
                actual = os.fstat(fd).st_size
                if actual != self.size:
                    raise ValueError(f"shared region {self.path} is {actual} bytes, expected {self.size} "
                                     f"({num_blocks} slots of {self.slot_stride} bytes)")
            self._mmap = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if self._finalizer is not None:
                self._finalizer()
            os.close(fd)
            raise
        if _create:
            self._lock_fd = fd
        else:
            os.close(fd)  # the mapping keeps the file alive
        self._view = memoryview(self._mmap)
        if pin == "true" or (pin == "auto" and _cuda_available()):
            self._pin(required=pin == "true")
        self.pinned = bool(self._pinned)

    @classmethod
    def attach(cls, shm_name: str, num_blocks: int, block_bytes: int, block_size: int = 0,
               name: str = "cpu", pin: str | bool = "auto") -> "CPUBackend":
        """Map a region created by another process (same geometry). `close` leaves the file in place."""
        return cls(name, num_blocks, block_bytes, block_size, shm_name=shm_name, pin=pin, _create=False)

    # ------------------------------------------------------------------ bytes
    def view(self, slot: int) -> memoryview:
        """The `block_bytes` bytes of one slot (writable; valid until `close`)."""
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"slot {slot} out of range 0..{self.num_blocks - 1}")
        start = slot * self.slot_stride
        return self._view[start:start + self.block_bytes]

    def tensor(self):
        """A uint8 tensor `(num_blocks, block_bytes)` over the region (row stride `slot_stride`), no copy."""
        if self._tensor is None:
            import torch

            flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self._tensor = flat.as_strided((self.num_blocks, self.block_bytes), (self.slot_stride, 1))
        return self._tensor

    def data_ptr(self) -> int:
        """Address of slot 0 in this process."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))

    # ------------------------------------------------------------------ pinning
    def _pin(self, required: bool) -> None:
        import torch

        if not torch.cuda.is_available():
            if required:
                raise RuntimeError(f"CPUBackend {self.name!r}: pin=true but CUDA is not available")
            return
        cudart = torch.cuda.cudart()
        base = self.data_ptr()
        rows = max(_MAX_REGISTER_BYTES // self.slot_stride, 1)
        chunk = rows * self.slot_stride  # chunks end on slot boundaries: no block straddles two
        for offset in range(0, self.size, chunk):
            addr, length = base + offset, min(chunk, self.size - offset)
            err = cudart.cudaHostRegister(addr, length, _CUDA_HOST_REGISTER_PORTABLE)
            if int(err) != 0:
                _clear_cuda_error()
                self._unpin()
                message = f"CPUBackend {self.name!r}: cudaHostRegister failed ({err}) at offset {offset}"
                if required:
                    raise RuntimeError(message)
                log.warning("%s; the region stays pageable", message)
                return
            self._pinned.append(addr)

    def _unpin(self) -> None:
        if not self._pinned:
            return
        import torch

        cudart = torch.cuda.cudart()
        for addr in reversed(self._pinned):
            cudart.cudaHostUnregister(addr)
        self._pinned.clear()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Unpin and unmap; the creating process also removes the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unpin()
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
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __repr__(self) -> str:
        return (f"CPUBackend({self.name!r}, {self.num_blocks} x {self.block_bytes} B, shm={self.shm_name!r}, "
                f"pinned={self.pinned})")
