"""The file tier's I/O (`BlockIO` and its kinds): positioned reads and writes of whole byte ranges
of one file.

A `BlockIO` is synchronous per call (`pwrite(offset, buf)` / `pread(offset, buf)` move all of `buf`
or raise `OSError`); the file backend runs several calls at once on its own thread pool.

- `PosixIO`: os.pwrite / os.preadv on one descriptor, O_DIRECT when the filesystem allows it
  (buffers handed to it are page-aligned bounce buffers, offsets and sizes multiples of 4 KiB).
- `KvikioIO`: kvikio.CuFile futures (its own thread pool and, with real GDS, device paths).
  kvikio is optional and imported lazily.

`choose_io` resolves the `io` option (`auto` | `posix` | `kvikio`).

No process-wide state is left changed: kvikio's compatibility mode is set only while a `KvikioIO`
opens its file (the file keeps it), and kvikio's process-wide thread pool is raised while
`KvikioIO`s are open and back to its size once the last one is closed (`_KvikioThreads`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
from abc import ABC, abstractmethod

from kvtier.tiers.file.rootdir import file_kind, open_existing

log = logging.getLogger("kvtier.tiers.file")  # the file tier's one logger (documented in tiers/file/backend.py)

ALIGN = 4096


class NotRegularFileError(OSError):
    """A path that must name a regular file names a symlink, FIFO, device, socket or directory."""


class FileTooLargeError(OSError):
    """A metadata file is larger than anything this version writes there."""


def _not_regular(path, mode: int) -> NotRegularFileError:
    return NotRegularFileError(errno.EINVAL, f"not a regular file ({file_kind(mode)})", str(path))


def open_regular_file(path, dir_fd: int | None = None) -> int:
    """A read-only descriptor on `path` (with `dir_fd`: its last name, in that directory), which
    must be a regular file, not reached through a symlink in its last component. A device, FIFO
    or socket is refused before it is opened (lstat: opening some devices has side effects); the
    open itself never follows a symlink
    (O_NOFOLLOW) nor blocks (O_NONBLOCK, cleared after), and the check is repeated on the
    descriptor (fstat), so a file swapped in between is refused too.
    Raises `NotRegularFileError` ("not a regular file (a FIFO)"), or the OSError of lstat/open
    (FileNotFoundError, PermissionError, ...)."""
    name = path if dir_fd is None else os.path.basename(path)
    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a symlink since the lstat
            raise _not_regular(path, stat.S_IFLNK) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path, limit: int, dir_fd: int | None = None) -> bytes:
    """The whole contents of the regular file `path` (see `open_regular_file`), at most `limit`
    bytes: a larger file raises `FileTooLargeError` without being read past `limit` + 1 bytes."""
    fd = open_regular_file(path, dir_fd)
    try:
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = os.read(fd, min(limit + 1 - total, 1 << 24))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    raise FileTooLargeError(errno.EFBIG, f"larger than the {limit} bytes this file can hold", str(path))


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned, writable anonymous mapping of `nbytes` (rounded up to a page)."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN))


def buffer_address(view: memoryview) -> int:
    """Address of a writable buffer's first byte (O_DIRECT needs it page-aligned)."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def direct_refusal(path: str) -> str | None:
    """Why `path` (an existing file of at least 4 KiB) cannot be read and written with O_DIRECT,
    or None when it can. Like every open of a `BlockIO`, it never follows a symlink
    (`rootdir.open_existing`)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return "this platform has no O_DIRECT"
    buf = aligned_buffer(ALIGN)
    try:
        fd = open_existing(path, os.O_RDWR | flag)
        try:
            if os.preadv(fd, [buf], 0) == ALIGN and os.pwritev(fd, [buf], 0) == ALIGN:
                return None
            return "a 4 KiB O_DIRECT probe moved a short count"
        finally:
            os.close(fd)
    except OSError as exc:
        return f"O_DIRECT refused ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    finally:
        buf.close()


def probe_direct(path: str) -> bool:
    """Whether `path` can be read and written with O_DIRECT (see `direct_refusal`)."""
    return direct_refusal(path) is None


class BlockIO(ABC):
    """Positioned I/O on one file. `pwrite`/`pread` move the whole buffer or raise OSError."""

    name: str = "?"
    direct: bool = False
    vectored: bool = False  # offers pwritev/preadv (scatter-gather over the caller's buffers)

    @abstractmethod
    def pwrite(self, offset: int, buf) -> None: ...

    def pwritev(self, offset: int, iovs: list) -> None:
        """Write the concatenation of `iovs` at `offset`; only where `vectored`."""
        raise NotImplementedError(f"{type(self).__name__} has no vectored I/O")

    def preadv(self, offset: int, iovs: list) -> None:
        """Fill `iovs` in order from `offset`; only where `vectored`."""
        raise NotImplementedError(f"{type(self).__name__} has no vectored I/O")

    @abstractmethod
    def pread(self, offset: int, buf) -> None: ...

    @abstractmethod
    def sync(self) -> None:
        """Make every completed write durable (fdatasync)."""

    @abstractmethod
    def close(self) -> None: ...


class PosixIO(BlockIO):
    """pwrite/preadv on one descriptor; O_DIRECT when `direct`."""

    name = "posix"
    vectored = True

    def __init__(self, path: str, direct: bool):
        self.direct = direct
        flags = os.O_RDWR | (getattr(os, "O_DIRECT", 0) if direct else 0)
        self.fd = open_existing(path, flags)
        self._closed = False

    def pwrite(self, offset: int, buf) -> None:
        view = memoryview(buf).cast("B")
        done, total = 0, len(view)
        while done < total:
            n = os.pwrite(self.fd, view[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {n} bytes at offset {offset + done}")
            done += n

    def pread(self, offset: int, buf) -> None:
        view = memoryview(buf).cast("B")
        done, total = 0, len(view)
        while done < total:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read: end of file at offset {offset + done} "
                                         f"({total - done} of {total} bytes missing)")
            done += n

    def pwritev(self, offset: int, iovs: list) -> None:
        """Write the concatenation of `iovs` at `offset` (scatter-gather, no copy)."""
        self._vector(os.pwritev, offset, iovs, "write")

    def preadv(self, offset: int, iovs: list) -> None:
        """Fill `iovs` in order from `offset`; a short read raises OSError."""
        self._vector(os.preadv, offset, iovs, "read")

    def _vector(self, call, offset: int, iovs: list, what: str) -> None:
        total = sum(len(v) for v in iovs)
        done = call(self.fd, iovs, offset)
        while done < total:  # partial transfer (rare): go on with the iovecs not yet done
            if done <= 0:
                raise OSError(errno.EIO, f"short {what}: {total - done} of {total} bytes not moved at offset "
                                         f"{offset + done} (end of file?)")
            skip, iovs = done, _advance(iovs, done)
            offset, total = offset + skip, total - skip
            done = call(self.fd, iovs, offset)

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)


def _advance(iovs: list, n: int) -> list:
    """The iovecs left after the first `n` bytes of `iovs` were moved."""
    left = []
    for v in iovs:
        if n >= len(v):
            n -= len(v)
            continue
        left.append(v[n:] if n else v)
        n = 0
    return left


def kvikio_importable() -> bool:
    """Whether `import kvikio` works (it raises non-ImportError errors when libcufile is missing)."""
    try:
        import kvikio  # noqa: F401
    except Exception:  # noqa: BLE001 - DynamicLibNotFoundError and friends
        return False
    return True


def gpu_present() -> bool:
    """Whether an NVIDIA GPU is visible (device nodes), without importing torch or CUDA."""
    return os.path.exists("/dev/nvidia0") or bool(_listdir("/proc/driver/nvidia/gpus"))


def gds_platform() -> bool:
    """Whether cuFile may be called at all: libcufile spins forever without /proc/modules, and
    GDS needs the nvidia-fs driver (see notes/kvikio.md)."""
    return os.path.exists("/proc/modules") and os.path.exists("/proc/driver/nvidia-fs/devcount")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


class _KvikioThreads:
    """kvikio's thread pool is process-wide (default 1 thread). Each open `KvikioIO` holds a
    lease of the threads it needs: the pool is raised to the most any lease asks for, and set back
    to its size before the first lease when the last one is released."""

    def __init__(self):
        self._lock = threading.Lock()
        self._leases = 0
        self._size_before = 0  # the pool's size before the first of the live leases

    def lease(self, defaults, num_threads: int) -> None:
        with self._lock:
            current = int(defaults.get("num_threads"))
            if self._leases == 0:
                self._size_before = current
            self._leases += 1
            if num_threads > current:
                defaults.set("num_threads", num_threads)

    def release(self, defaults) -> None:
        with self._lock:
            self._leases -= 1
            if self._leases == 0 and int(defaults.get("num_threads")) != self._size_before:
                defaults.set("num_threads", self._size_before)


_kvikio_threads = _KvikioThreads()  # kvikio's pool is one per process, so are its leases


class KvikioIO(BlockIO):
    """kvikio.CuFile on the slab: pwrite/pread futures, waited on by the calling thread.

    Compat mode (POSIX inside kvikio) is forced for this file unless the platform has nvidia-fs
    (set while the file is opened, then restored: the file keeps the mode it was opened with);
    kvikio's thread pool holds at least `num_threads` while this file is open.
    """

    name = "kvikio"

    def __init__(self, path: str, num_threads: int):
        import kvikio
        import kvikio.defaults  # a submodule: not loaded by `import kvikio`
        import numpy as np

        self._np = np
        self._defaults = kvikio.defaults
        # opened (O_NOFOLLOW, checked) before CuFile, which takes a path and no flags: a symlink is
        # refused first; root_dir being yours and private, nobody can swap the file in between
        self._sync_fd = open_existing(path, os.O_RDWR)
        try:
            compat = {} if gds_platform() else {"compat_mode": kvikio.CompatMode.ON}
            with kvikio.defaults.set(compat) if compat else contextlib.nullcontext():
                self._file = kvikio.CuFile(path, "r+")
        except BaseException:
            os.close(self._sync_fd)
            raise
        try:
            _kvikio_threads.lease(kvikio.defaults, num_threads)
        except BaseException:
            self._file.close()
            os.close(self._sync_fd)
            raise
        self._closed = False

    def _array(self, buf):
        return self._np.frombuffer(buf, dtype=self._np.uint8)

    def pwrite(self, offset: int, buf) -> None:
        arr = self._array(buf)
        n = self._file.pwrite(arr, arr.nbytes, offset).get()
        if n != arr.nbytes:
            raise OSError(errno.EIO, f"kvikio pwrite moved {n} of {arr.nbytes} bytes at offset {offset}")

    def pread(self, offset: int, buf) -> None:
        arr = self._array(buf)
        try:
            n = self._file.pread(arr, arr.nbytes, offset).get()
        except RuntimeError as exc:  # kvikio reports EOF and I/O errors as RuntimeError
            raise OSError(errno.EIO, f"kvikio pread at offset {offset}: {exc}") from exc
        if n != arr.nbytes:
            raise OSError(errno.EIO, f"kvikio pread moved {n} of {arr.nbytes} bytes at offset {offset}")

    def sync(self) -> None:
        os.fdatasync(self._sync_fd)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._file.close()
                os.close(self._sync_fd)
            finally:
                _kvikio_threads.release(self._defaults)


def choose_io(io: str, path: str, num_threads: int, *, tier: str) -> BlockIO:
    """Open `path` with the `BlockIO` that `io` asks for, for the file tier named `tier` (in warnings).
    `auto` = kvikio where GPUDirect Storage is real (a GPU, the nvidia-fs driver: `gds_platform`)
    and kvikio imports, else posix: without nvidia-fs kvikio only bounces through its own buffers,
    no faster than O_DIRECT from host memory (docs/benchmarks.md); an `auto` kvikio that fails its
    first I/O falls back to posix with a warning. `kvikio` failing raises OSError/RuntimeError
    naming the cause. A `PosixIO` uses O_DIRECT when the filesystem takes it, else buffered I/O
    (one warning saying why)."""
    if io == "auto":
        if gpu_present() and gds_platform() and kvikio_importable():
            kvikio_io = None
            try:
                kvikio_io = KvikioIO(path, num_threads)
                probe = aligned_buffer(ALIGN)
                kvikio_io.pread(0, probe)
                probe.close()
                return kvikio_io
            except Exception as exc:  # noqa: BLE001 - any kvikio failure: use posix instead
                log.warning("file tier %s: kvikio unusable (%s: %s); using posix I/O", tier, type(exc).__name__, exc)
                if kvikio_io is not None:
                    kvikio_io.close()
        io = "posix"
    if io == "kvikio":
        return KvikioIO(path, num_threads)
    if io == "posix":
        refused = direct_refusal(path)
        if refused is not None:
            log.warning("file tier %s: %s on the filesystem of %s; using buffered I/O (page cache)", tier, refused,
                        path)
        return PosixIO(path, refused is None)
    raise ValueError(f"unknown io {io!r} (auto | posix | kvikio)")
