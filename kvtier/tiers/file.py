"""`FileBackend`: blocks in a preallocated slab file under `root_dir` (the FILE medium).

On-disk layout of `root_dir` (directory 0700 when created here, files 0600):
- `lock`           flock'ed exclusively by the owning process, which writes its pid there.
- `manifest.json`  geometry (block_bytes, slot_bytes, num_slots, header_bytes, format version),
                   `fingerprint` (whose KV this is: the model identity, never empty), `layout`
                   (block geometry, dtypes and shapes, from the builder) and a random `epoch`
                   chosen at each (re)build.
- `slab.0`         `num_slots` fixed slots of `slot_bytes` (a multiple of 4 KiB). A slot is a
                   512-byte header (magic, version, key, payload length, CRC-32 of the payload,
                   digest of the manifest incl. epoch, CRC-32 of the header) then the payload.
- `journal`        append-only records `PUT(slot, key, crc)` / `DEL(slot)`, each with its own CRC,
                   after a header naming the epoch, written in place into a zero-filled
                   preallocated file. A PUT is appended once the slot's bytes are written, so
                   both survive a killed process. Power-loss durability follows `sync_interval`:
                   0 = before `write_blocks` returns, the slab is fdatasync'ed, then the journal
                   (concurrent writers share one of each: group commit); N > 0 = a background
                   thread does the same every N seconds (and `sync()`/`close()` on demand). A
                   PUT that reaches the disk before its slot's bytes is harmless: the slot then
                   fails verification and is dropped. Replayed at start (no slot header is
                   read: 100k blocks are ready in well under a second), rewritten with the live
                   entries only (compacted) past twice the capacity in records or when its file
                   is full.
                   DELs of evicted slots ride along with the next append (losing them in a
                   crash only brings back blocks that still verify).

Paths: `root_dir` and its files must be the user's and not writable by group/others, and nothing
in it is opened through a symlink (kvtier/tiers/rootdir.py); anything else is refused at build with
a `ConfigError` on `root_dir`, and a build that fails removes the files and directories it created.

Trust rules: a manifest that differs from this configuration (or a journal of another epoch) means
the contents are not ours: the tier starts empty and logs one warning. A block is served only if
its header (magic, version, manifest digest, key, length, header CRC) and payload CRC verify;
otherwise `read_blocks` raises `IntegrityError` and the block is forgotten. The manifest and the
journal are read only when they are regular files (not through a symlink: a FIFO or /dev/zero is
never read) no larger than this version writes (1 MiB; the journal's bound follows from
`num_slots`); otherwise they are not ours either. A journal record naming a slot past the slab or
a key no slot header can hold is ignored, with one warning counting them, and the journal is
rewritten without it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import stat
import struct
import threading
import uuid
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config import REQUIRED, format_size
from kvtier.errors import ConfigError, IntegrityError, KVTierError
from kvtier.keys import OffloadKey
from kvtier.specs import FileLoadStoreSpec
from kvtier.tiers.base import Backend
from kvtier.tiers.fileio import aligned_buffer, buffer_address, choose_engine, file_kind, read_regular_file
from kvtier.tiers.rootdir import (check_entries, create_new, expand_root_dir, open_existing, open_or_create,
                                  prepare_root, refuse, remove_dirs, remove_file)
from kvtier.types import BlockStatus

log = logging.getLogger("kvtier.tiers.file")

FORMAT_VERSION = 1
ALIGN = 4096
HEADER_BYTES = 512
RUN_BYTES = 8 << 20  # adjacent slots are merged into I/Os of about this size (a whole number of slots)

MANIFEST = "manifest.json"
SLAB = "slab.0"
JOURNAL = "journal"
LOCK = "lock"
TMP = ".tmp"  # suffix of the file a manifest or journal is written to before it replaces the old one
OWN_FILES = (LOCK, MANIFEST, SLAB, JOURNAL)  # with TEMPORARIES, all that the tier writes in root_dir
TEMPORARIES = (MANIFEST + TMP, JOURNAL + TMP)  # never opened: a leftover is unlinked and created afresh

_SLOT_MAGIC = b"KVTB"
# magic, version, key_len, payload_len, payload_crc, manifest digest, header_crc; the key follows.
_HDR = struct.Struct("<4sHHQI8sI")
MAX_KEY_BYTES = HEADER_BYTES - _HDR.size

_JOURNAL_MAGIC = b"KVTJ"
_JHDR = struct.Struct("<4sI16s")  # magic, version, epoch
# record crc, op, key_len, slot, payload crc; the key follows. The CRC covers everything after it.
_REC = struct.Struct("<IBxHQI")
_PUT, _DEL = 1, 2


def _payload_crc32():
    """The fastest available implementation of zlib's CRC-32 (identical values, so the on-disk
    format does not depend on it): zlib-ng or ISA-L (~50 GB/s with carry-less multiply) when
    installed, else zlib (~6 GB/s). Payload checksums are the only CPU work per byte on the hop."""
    import importlib

    for module in ("zlib_ng.zlib_ng", "isal.isal_zlib"):
        try:
            return importlib.import_module(module).crc32
        except Exception:  # noqa: BLE001 - optional accelerators
            continue
    return zlib.crc32


payload_crc32 = _payload_crc32()


def slot_bytes_for(block_bytes: int) -> int:
    """Size of one slot: header + payload, rounded up to 4 KiB."""
    return -(-(HEADER_BYTES + block_bytes) // ALIGN) * ALIGN


# ---------------------------------------------------------------------------- manifest
def manifest_digest(manifest: dict) -> bytes:
    """8-byte digest of a manifest (epoch included), stamped into every slot header."""
    return hashlib.blake2b(json.dumps(manifest, sort_keys=True).encode(), digest_size=8).digest()


MANIFEST_MAX_BYTES = 1 << 20  # a manifest is a few hundred bytes: anything this big is not one


def load_manifest(root: Path) -> tuple[dict | None, str | None]:
    """(the manifest of `root`, None), or (None, why it is missing or unreadable). Only a regular
    file is read, and at most `MANIFEST_MAX_BYTES` of it (a symlink to /dev/zero is refused)."""
    try:
        data = json.loads(read_regular_file(root / MANIFEST, MANIFEST_MAX_BYTES))
    except FileNotFoundError:
        return None, f"{MANIFEST} missing"
    except OSError as exc:
        return None, f"{MANIFEST}: {exc.strerror or exc}"
    except (ValueError, RecursionError):  # not JSON (or JSON nested past the parser's depth)
        return None, f"{MANIFEST} is not JSON"
    if not isinstance(data, dict):
        return None, f"{MANIFEST} holds a {type(data).__name__}, not an object"
    return data, None


def read_manifest(root: Path) -> dict | None:
    """The manifest of `root`, or None if missing or unreadable (see `load_manifest`)."""
    return load_manifest(root)[0]


_GEOMETRY = ("format_version", "block_bytes", "slot_bytes", "header_bytes", "num_slots", "fingerprint", "layout")


def manifest_differences(found: dict | None, wanted: dict) -> list[str]:
    """Human-readable differences in geometry/fingerprint (empty when the contents are ours)."""
    if found is None:
        return ["no readable manifest"]
    return [f"{k}: found {found.get(k)!r}, configured {wanted[k]!r}" for k in _GEOMETRY if found.get(k) != wanted[k]]


# ---------------------------------------------------------------------------- slot header
def pack_header(view: memoryview, key: bytes, payload_len: int, payload_crc: int, digest: bytes) -> None:
    """Write a slot header into `view[:HEADER_BYTES]`."""
    fixed = _HDR.pack(_SLOT_MAGIC, FORMAT_VERSION, len(key), payload_len, payload_crc, digest, 0)
    hcrc = zlib.crc32(key, zlib.crc32(fixed))
    _HDR.pack_into(view, 0, _SLOT_MAGIC, FORMAT_VERSION, len(key), payload_len, payload_crc, digest, hcrc)
    view[_HDR.size:_HDR.size + len(key)] = key


@dataclass
class SlotHeader:
    key: bytes
    payload_len: int
    payload_crc: int
    digest: bytes


def parse_header(view) -> SlotHeader | str:
    """The header at the start of `view`, or a string saying why it is not a valid header."""
    magic, version, key_len, payload_len, payload_crc, digest, hcrc = _HDR.unpack_from(view, 0)
    if magic != _SLOT_MAGIC:
        return "no slot header (bad magic)"
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}"
    if key_len > MAX_KEY_BYTES:
        return f"key length {key_len} out of range"
    key = bytes(view[_HDR.size:_HDR.size + key_len])
    fixed = _HDR.pack(magic, version, key_len, payload_len, payload_crc, digest, 0)
    if zlib.crc32(key, zlib.crc32(fixed)) != hcrc:
        return "header checksum mismatch"
    return SlotHeader(key, payload_len, payload_crc, digest)


def verify_slot(view: memoryview, key: bytes | None, block_bytes: int, digest: bytes) -> str | None:
    """Check one slot image (`view` = header + payload); None if it may be served, else why not.
    `key=None` accepts any key (inspection)."""
    return verify_parts(view, view[HEADER_BYTES:HEADER_BYTES + block_bytes], key, block_bytes, digest)


def verify_parts(header_view, payload, key: bytes | None, block_bytes: int, digest: bytes) -> str | None:
    """`verify_slot` with the header and the payload in separate buffers."""
    header = parse_header(header_view)
    if isinstance(header, str):
        return header
    if header.digest != digest:
        return "written under another manifest (fingerprint, geometry or epoch differs)"
    if key is not None and header.key != key:
        return "holds another key"
    if header.payload_len != block_bytes:
        return f"payload length {header.payload_len}, expected {block_bytes}"
    if payload_crc32(payload) != header.payload_crc:
        return "payload checksum mismatch"
    return None


# ---------------------------------------------------------------------------- journal
@dataclass
class JournalScan:
    """What a journal says: live `entries` slot -> (key, crc, seq), in record order."""

    epoch: bytes | None = None
    entries: dict[int, tuple[bytes, int, int]] = field(default_factory=dict)
    records: int = 0
    good_bytes: int = 0  # length of the valid prefix (where the next record goes)
    torn_bytes: int = 0  # non-zero bytes after it (a torn or corrupt tail), ignored
    problem: str | None = None  # why the journal is unusable as a whole, if it is
    beyond: int = 0  # well-formed records naming a slot >= num_slots: ignored
    bad_keys: int = 0  # well-formed PUTs of a key longer than a slot header holds: ignored

    def ignored(self) -> str | None:
        """What was ignored, for a warning or a report (None when nothing was)."""
        parts = []
        if self.beyond:
            parts.append(f"{self.beyond} journal records name slots beyond the slab")
        if self.bad_keys:
            parts.append(f"{self.bad_keys} journal records hold keys longer than {MAX_KEY_BYTES} bytes")
        return "; ".join(parts) + " (ignored)" if parts else None


def journal_capacity(num_slots: int, compact_min_records: int) -> int:
    """Size of a fresh journal file: room for the records written between two compactions
    (past max(compact_min_records, 2 x num_slots) of them), keys of ~36 bytes, in whole MiB."""
    threshold = max(compact_min_records, 2 * num_slots) + 64
    return -(-threshold * (_REC.size + 44) // (1 << 20)) * (1 << 20)


def journal_max_bytes(num_slots: int, capacity: int) -> int:
    """The largest journal this version writes for `num_slots` slots whose fresh journal file is
    `capacity` bytes (a compaction of every slot with the longest keys grows it to twice their
    need), plus 1 MiB of slack: a larger file is not ours."""
    compacted = 2 * (_JHDR.size + num_slots * (_REC.size + MAX_KEY_BYTES))
    return max(capacity, compacted) + (1 << 20)


def scan_journal(data: bytes, num_slots: int | None = None) -> JournalScan:
    """Replay journal bytes; stops at the first record that is truncated or fails its CRC.

    A well-formed record that cannot describe this slab (a slot >= `num_slots`, a key longer than
    a slot header holds) is skipped and counted (`beyond`, `bad_keys`), never entered."""
    scan = JournalScan()
    if len(data) < _JHDR.size:
        scan.problem = "journal missing or shorter than its header"
        return scan
    magic, version, epoch = _JHDR.unpack_from(data, 0)
    if magic != _JOURNAL_MAGIC or version != FORMAT_VERSION:
        scan.problem = "journal header not recognised"
        return scan
    scan.epoch = epoch
    entries = scan.entries
    pos, end, rec_size, unpack, crc32 = _JHDR.size, len(data), _REC.size, _REC.unpack_from, zlib.crc32
    records = 0
    pop = entries.pop
    limit = (1 << 64) if num_slots is None else num_slots
    while pos + rec_size <= end:
        rcrc, op, key_len, slot, pcrc = unpack(data, pos)
        stop = pos + rec_size + key_len
        if stop > end or crc32(data[pos + 4:stop]) != rcrc:
            break
        if op not in (_PUT, _DEL):
            break
        if slot >= limit:
            scan.beyond += 1
        elif op == _PUT and key_len > MAX_KEY_BYTES:
            scan.bad_keys += 1
        elif op == _PUT:
            pop(slot, None)  # keep dict order = order of the latest record
            entries[slot] = (data[pos + rec_size:stop], pcrc, records)
        else:
            pop(slot, None)
        records += 1
        pos = stop
    scan.records = records
    scan.good_bytes = pos
    # The file is preallocated with zeros: only non-zero bytes after the valid prefix are a torn tail.
    scan.torn_bytes = max(0, len(data.rstrip(b"\0")) - pos)
    return scan


def _record(op: int, slot: int, key: bytes = b"", crc: int = 0) -> bytes:
    body = _REC.pack(0, op, len(key), slot, crc)[4:] + key
    return struct.pack("<I", zlib.crc32(body)) + body


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with a file holding `data` (a crash leaves the old or the new one). The
    temporary file is created afresh (O_EXCL: a leftover, or a symlink planted there, is unlinked
    first, never followed) and removed if writing fails."""
    tmp = path.with_name(path.name + TMP)
    remove_file(tmp)
    fd = create_new(tmp, os.O_WRONLY)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # replaces a symlink at `path` itself, never its target
    except BaseException:
        remove_file(tmp)
        raise
    _fsync_dir(path.parent)


class Journal:
    """The index of committed slots: records appended in place into a zero-filled, preallocated
    file (so an append + fdatasync changes no file metadata: no filesystem journal commit).
    Not thread-safe: the backend holds its lock."""

    def __init__(self, path: Path, epoch: bytes, pos: int, capacity: int, records: int = 0):
        self.path = path
        self.epoch = epoch
        self.pos = pos  # where the next record goes
        self.capacity = capacity
        self.records = records
        self.fd = open_existing(path, os.O_WRONLY)

    @classmethod
    def create(cls, path: Path, epoch: bytes, entries: Iterable[tuple[int, bytes, int]] = (),
               capacity: int = 1 << 20) -> "Journal":
        """Write a fresh journal holding `entries` (slot, key, crc) atomically, and open it.
        The file is `capacity` bytes, grown to twice what the entries need when they do not fit."""
        records = b"".join(_record(_PUT, slot, key, crc) for slot, key, crc in entries)
        used = _JHDR.size + len(records)
        capacity = max(capacity, 2 * used)
        header = _JHDR.pack(_JOURNAL_MAGIC, FORMAT_VERSION, epoch)
        _write_file_atomic(path, header + records + bytes(capacity - used))
        return cls(path, epoch, used, capacity, records=_count_records(records))

    def fits(self, nbytes: int) -> bool:
        return self.pos + nbytes <= self.capacity

    def append(self, records: list[bytes], durable: bool = True) -> None:
        """Write `records` after the last one; fdatasync them too when `durable`."""
        if records:
            data = memoryview(b"".join(records))
            if not self.fits(len(data)):
                raise OSError(errno.ENOSPC, f"journal {self.path} is full")
            done = 0
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], self.pos + done)
            if durable:
                os.fdatasync(self.fd)
            self.pos += len(data)
            self.records += len(records)

    def zero_tail(self, nbytes: int) -> None:
        """Overwrite a torn tail after `pos` with zeros (durably)."""
        os.pwrite(self.fd, bytes(nbytes), self.pos)
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _count_records(data: bytes) -> int:
    count, pos = 0, 0
    while pos < len(data):
        _c, _op, key_len, _slot, _crc = _REC.unpack_from(data, pos)
        pos += _REC.size + key_len
        count += 1
    return count


class _PendingCommit:
    """One write_blocks call waiting for its group commit."""

    __slots__ = ("entries", "done", "error")

    def __init__(self, entries: list[tuple[int, bytes, int]]):
        self.entries = entries
        self.done = False
        self.error: BaseException | None = None


# ---------------------------------------------------------------------------- options
_root_dir = expand_root_dir  # `~` and `$VAR`s expanded; what cannot be a root_dir is refused


def _io(v) -> str:
    if v not in ("auto", "posix", "kvikio"):
        raise ValueError(f"{v!r} is not an I/O engine; use auto, posix or kvikio")
    return v


def _fingerprint(v) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string identifying the model and KV layout, got {type(v).__name__} {v!r}")
    return v


def _sync_interval(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 3600:
        raise ValueError(f"expected seconds between background fdatasyncs from 0 (each store job durable "
                         f"before it completes) to 3600, got {v!r}")
    return float(v)


def _threads(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 256:
        raise ValueError(f"expected a number of I/O threads between 1 and 256, got {v!r}")
    return v


# ---------------------------------------------------------------------------- backend
class FileBackend(Backend):
    """Fixed-size blocks in one preallocated slab file; see the module docstring for the format.

    Byte API (used by the CPU<->FILE and GPU<->FILE handlers), both safe to call from several
    threads at once for distinct slots:
    - `write_blocks(slots, keys, buffers) -> bytes written`: written and journalled when it returns
      (a killed process finds them again); durable against power loss at once with
      `sync_interval` 0, else within `sync_interval` seconds or at `sync()` / `close()`.
    - `read_blocks(slots, keys, buffers) -> bytes read`: raises `IntegrityError` if any block fails
      verification (the others are still read; bad ones are forgotten), `OSError` on I/O errors.
    """

    spec_type = FileLoadStoreSpec
    medium = "FILE"
    max_key_bytes = MAX_KEY_BYTES  # what a slot header leaves for the key
    persistent = True
    compact_min_records = 4096  # the journal is rewritten past max(this, 2 x capacity) records
    OPTIONS = {
        "root_dir": (REQUIRED, _root_dir),
        "io": ("auto", _io),
        "fingerprint": ("", _fingerprint),
        "num_threads": (4, _threads),
        "sync_interval": (1.0, _sync_interval),
    }

    def __init__(self, name: str, num_blocks: int, block_bytes: int, block_size: int = 0, *,
                 root_dir: str, io: str = "auto", fingerprint: str = "", num_threads: int = 4,
                 sync_interval: float = 1.0, layout: str = ""):
        super().__init__(name, num_blocks, block_bytes, block_size)
        if block_bytes <= 0:
            raise ValueError(f"file tier {name!r} needs block_bytes > 0, got {block_bytes}")
        _io(io), _fingerprint(fingerprint), _threads(num_threads)
        if not fingerprint:
            raise ConfigError([("fingerprint", f"empty: file tier {name!r} keeps blocks across restarts and must "
                                               f"not serve them to another model; give the identity of the model "
                                               f"whose KV it holds, e.g. 'meta-llama/Llama-3.1-8B@<revision>'")])
        # What decides the bytes of a block besides the model (the builder's description, or the
        # geometry this tier knows: the same text `describe_layout` gives without KV caches).
        self.layout = layout or f"block_bytes={block_bytes} block_tokens={block_size}"
        self.sync_interval = _sync_interval(sync_interval)
        try:
            root_dir = _root_dir(root_dir)
        except ValueError as exc:
            raise refuse(str(exc)) from None
        self.root = Path(root_dir)  # resolved by _make_root
        self.slot_bytes = slot_bytes_for(block_bytes)
        self.num_threads = num_threads
        self.slab_path = self.root / SLAB
        self._closed = False
        self._lock_fd = -1
        self._index: dict[int, tuple[bytes, int, int]] = {}  # slot -> (key, crc, seq): committed blocks
        self._seq = 0
        self._pending_del: list[int] = []
        self._jlock = threading.Lock()
        self._commit_cv = threading.Condition()
        self._commit_queue: list[_PendingCommit] = []
        self._committing = False
        self._dirty = False  # journalled since the last sync (sync_interval > 0)
        self._sync_lock = threading.Lock()
        self._stop_syncer = threading.Event()
        self._syncer: threading.Thread | None = None
        self._recovered = False
        self.io = None
        self.journal: Journal | None = None
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=f"kvtier-file-{name}")
        self._run_slots = max(1, round(RUN_BYTES / self.slot_bytes))
        self._buffers: queue.SimpleQueue = queue.SimpleQueue()
        self._zero_copy_ok = False
        self._created_dirs: list[Path] = []  # this build's: removed with its files if it fails
        self._created_files: list[Path] = []
        try:
            self._make_root()
            self._acquire_lock()
            present = check_entries(self.root, OWN_FILES)
            self._created_files += [self.root / n for n in OWN_FILES + TEMPORARIES if n not in present]
            self._open(fingerprint)
            self.io = choose_engine(io, str(self.slab_path), num_threads)
            pad = self.slot_bytes - HEADER_BYTES - block_bytes
            self._zero_copy_ok = hasattr(self.io, "pwritev") and (not self.io.direct or block_bytes % ALIGN == 0)
            self._pad = memoryview(aligned_buffer(pad))[:pad] if pad else None  # written as is: contents unused
            self._pad_in = memoryview(aligned_buffer(pad))[:pad] if pad else None  # read into and ignored
            if self.sync_interval > 0:
                self._syncer = threading.Thread(target=self._sync_loop, name=f"kvtier-sync-{name}", daemon=True)
                self._syncer.start()
        except BaseException as exc:
            self._remove_created()  # while the lock is held: nobody else is using these files
            self.close()
            if isinstance(exc, OSError) and not isinstance(exc, KVTierError):
                raise self._build_error(exc) from exc
            raise

    # ------------------------------------------------------------------ start-up
    def _make_root(self) -> None:
        """Resolve `root_dir`, creating what is missing (0700); refuse an unsafe one (rootdir.py)."""
        self.root, self._created_dirs = prepare_root(str(self.root))
        self.slab_path = self.root / SLAB

    def _acquire_lock(self) -> None:
        path = self.root / LOCK
        while True:
            fd, created = open_or_create(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                finally:
                    os.close(fd)
                raise KVTierError(f"file tier root_dir {self.root} is locked by another user (pid {holder}); "
                                  f"give each process its own root_dir") from None
            if _same_file(fd, path):
                break
            os.close(fd)  # a failed build removed the file after we opened it: lock the current one
        if created:
            self._created_files.append(path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _remove_created(self) -> None:
        """Undo a failed build: unlink the files and directories it created (none were there before)."""
        for path in reversed(self._created_files):
            remove_file(path)
        remove_dirs(self._created_dirs)

    def _build_error(self, exc: OSError) -> KVTierError:
        """The `root_dir` error for an OS error met while building the tier."""
        if exc.errno == errno.ENOSPC:
            return self._no_space(f"{exc.strerror} while creating them")
        return refuse(f"file tier {self.name!r} cannot use {self.root}: {exc}")

    def _no_space(self, found: str) -> KVTierError:
        slab, journal = self.num_blocks * self.slot_bytes, self._journal_capacity()
        return refuse(f"not enough free space in {self.root} for file tier {self.name!r}: its slab of "
                      f"{self.num_blocks} blocks ({format_size(slab)}) and its journal ({format_size(journal)}) "
                      f"are preallocated; {found}. Lower the tier's capacity or choose another root_dir")

    def _check_free_space(self) -> None:
        """Refuse before touching anything when the slab and the journal would not both fit (the
        old slab is truncated first; the old journal is replaced only after the new one is written)."""
        need = self.num_blocks * self.slot_bytes + self._journal_capacity() + ALIGN  # + the manifest
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        try:
            reused = os.lstat(self.slab_path).st_blocks * 512
        except FileNotFoundError:
            reused = 0
        if need > free + reused:
            raise self._no_space(f"{format_size(free)} free")

    def _wanted_manifest(self, fingerprint: str) -> dict:
        return {"format_version": FORMAT_VERSION, "block_bytes": self.block_bytes, "slot_bytes": self.slot_bytes,
                "header_bytes": HEADER_BYTES, "num_slots": self.num_blocks, "fingerprint": fingerprint,
                "layout": self.layout, "slab": SLAB}

    def _open(self, fingerprint: str) -> None:
        self._refuse_foreign_slab()
        wanted = self._wanted_manifest(fingerprint)
        found, unreadable = load_manifest(self.root)
        diffs = [f"no readable manifest: {unreadable}"] if unreadable else manifest_differences(found, wanted)
        scan = None
        if not diffs:
            scan = self._scan_journal()
            try:
                epoch = bytes.fromhex(str(found.get("epoch", "")))
            except ValueError:  # a hand-edited or foreign manifest
                epoch = None
            if scan.problem is None and scan.epoch != epoch:
                scan.problem = "journal belongs to another epoch"
            if scan.problem is not None:
                diffs = [scan.problem]
        if diffs:
            if any(os.path.lexists(self.root / name) for name in (MANIFEST, SLAB)):
                log.warning("file tier %s: contents of %s are not ours (%s); starting empty", self.name, self.root,
                            "; ".join(diffs))
            self._rebuild(wanted)
            return
        self.manifest = found
        self.digest = manifest_digest(found)
        self._check_slab_size(scan)
        self._index = scan.entries
        self._seq = scan.records
        capacity = os.stat(self.root / JOURNAL).st_size
        self.journal = Journal(self.root / JOURNAL, scan.epoch, scan.good_bytes, capacity, scan.records)
        if scan.torn_bytes:
            log.warning("file tier %s: ignoring a torn journal tail of %d bytes", self.name, scan.torn_bytes)
            self.journal.zero_tail(scan.torn_bytes)
        if scan.ignored():
            log.warning("file tier %s: %s; rewriting the journal without them", self.name, scan.ignored())
            self._compact()

    def _scan_journal(self) -> JournalScan:
        """Replay the journal: a regular file no larger than this geometry ever writes, read
        whole; records that cannot describe this slab are ignored (counted in the scan)."""
        limit = journal_max_bytes(self.num_blocks, self._journal_capacity())
        try:
            data = read_regular_file(self.root / JOURNAL, limit)
        except OSError as exc:
            return JournalScan(problem=f"journal unreadable: {exc.strerror or exc}")
        return scan_journal(data, self.num_blocks)

    def _refuse_foreign_slab(self) -> None:
        """A slab path that exists but is not a regular file (a FIFO, a device, a symlink, a
        directory) was not made by kvtier: refuse it rather than block on it, write to it or remove it."""
        try:
            mode = os.lstat(self.slab_path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):
            raise KVTierError(f"file tier {self.name}: {self.slab_path} is not a regular file ({file_kind(mode)}); "
                              f"kvtier keeps its blocks in a regular file there: remove it or give the tier "
                              f"another root_dir")

    def _check_slab_size(self, scan: JournalScan) -> None:
        """A slab shorter than its geometry lost the blocks past its end: forget them, re-extend."""
        want = self.num_blocks * self.slot_bytes
        try:
            size = os.stat(self.slab_path).st_size
        except FileNotFoundError:
            size = 0
        if size >= want:
            return
        lost = [s for s in scan.entries if (s + 1) * self.slot_bytes > size]
        for slot in lost:
            del scan.entries[slot]
        log.warning("file tier %s: slab %s is %d bytes, expected %d; %d blocks past its end dropped",
                    self.name, self.slab_path, size, want, len(lost))
        self._allocate_slab(truncate=False)

    def _allocate_slab(self, truncate: bool) -> None:
        size = self.num_blocks * self.slot_bytes
        fd, _created = open_or_create(self.slab_path, os.O_RDWR)
        try:
            if truncate:
                os.ftruncate(fd, 0)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise self._no_space(f"{format_size(size)} could not be allocated") from exc
                os.ftruncate(fd, size)  # no fallocate on this filesystem: a sparse file
            os.fsync(fd)
        finally:
            os.close(fd)

    def _rebuild(self, wanted: dict) -> None:
        """Start empty: no manifest while the slab and journal are reset, then a new epoch."""
        self._check_free_space()
        remove_file(self.root / MANIFEST)
        self._allocate_slab(truncate=True)
        epoch = uuid.uuid4().bytes
        self.journal = Journal.create(self.root / JOURNAL, epoch, capacity=self._journal_capacity())
        manifest = {**wanted, "epoch": epoch.hex()}
        _write_file_atomic(self.root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        self.manifest = manifest
        self.digest = manifest_digest(manifest)
        self._index = {}
        self._seq = 0

    # ------------------------------------------------------------------ Backend API
    def recover(self) -> list[tuple[OffloadKey, BlockStatus]]:
        """Committed blocks from the journal (ready, slots claimed); a key found in several slots
        keeps its latest copy. Slot headers are not read here: bad blocks are dropped at read time."""
        if self._recovered:
            return []
        self._recovered = True
        with self._jlock:
            latest: dict[bytes, int] = {}
            stale = []
            for slot, (key, _crc, _seq) in self._index.items():  # record order: later wins
                old = latest.get(key)
                if old is not None:
                    stale.append(old)
                latest[key] = slot
            for slot in stale:
                self._forget(slot)
        found = []
        for slot in sorted(latest.values()):
            self.slots.claim(slot)
            block = BlockStatus(slot)
            block.ref_cnt = 0
            found.append((OffloadKey(self._index[slot][0]), block))
        return found

    def free(self, block: BlockStatus) -> None:
        super().free(block)
        with self._jlock:
            self._forget(block.block_id)

    def still_valid(self, block: BlockStatus) -> bool:
        """A block survives a failed read unless verification forgot it (bad header or checksum)."""
        with self._jlock:
            return block.block_id in self._index

    def _forget(self, slot: int) -> None:
        """Drop a slot from the index; its DEL record goes out with the next journal append."""
        if self._index.pop(slot, None) is not None:
            self._pending_del.append(slot)

    def get_load_store_spec(self, keys: Iterable[OffloadKey], blocks: Iterable[BlockStatus]) -> FileLoadStoreSpec:
        return FileLoadStoreSpec([b.block_id for b in blocks], list(keys), tier=self.name)

    def committed(self) -> dict[int, bytes]:
        """slot -> key of every committed block (a snapshot)."""
        with self._jlock:
            return {slot: key for slot, (key, _c, _s) in self._index.items()}

    # ------------------------------------------------------------------ byte API
    def write_blocks(self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence) -> int:
        """Write `buffers[i]` (block_bytes, C-contiguous) as the block `keys[i]` into `slots[i]`."""
        views = self._check(slots, keys, buffers, writable=False)
        runs = self._runs(slots)
        futures = [self._pool.submit(self._write_run, run, slots, keys, views) for run in runs]
        crcs: dict[int, int] = {}
        error = None
        for future in futures:  # wait for all: no write may still be in flight when we fail
            try:
                crcs.update(future.result())
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error
        self._commit([(slot, bytes(key), crcs[slot]) for slot, key in zip(slots, keys)])
        return len(slots) * self.block_bytes

    def _commit(self, entries: list[tuple[int, bytes, int]]) -> None:
        """Journal this caller's (already written) slots: at once when durability is left to the
        background syncer (`sync_interval` > 0), else durably (`_commit_durable`)."""
        if self.sync_interval == 0:
            self._commit_durable(entries)
            return
        with self._jlock:
            try:
                self._journal_entries(entries, durable=False)
            except BaseException:
                self._unindex(entries)
                raise
            self._dirty = True

    def _unindex(self, entries: list[tuple[int, bytes, int]]) -> None:
        """Forget slots whose new contents did not reach the journal (or, with `sync_interval` 0,
        were not made durable): their old index entries are stale too (caller holds `_jlock`)."""
        for slot, _key, _crc in entries:
            self._index.pop(slot, None)

    def _journal_entries(self, entries: list[tuple[int, bytes, int]], durable: bool) -> None:
        """Index `entries` and append their PUTs (after the pending DELs) to the journal, or
        compact it (caller holds `_jlock`)."""
        records = [_record(_DEL, s) for s in self._pending_del]
        self._pending_del = []
        records.extend(_record(_PUT, slot, key, crc) for slot, key, crc in entries)
        for slot, key, crc in entries:
            self._index.pop(slot, None)
            self._index[slot] = (key, crc, self._seq)
            self._seq += 1
        too_many = self.journal.records + len(records) > max(self.compact_min_records, 2 * self.num_blocks)
        if too_many or not self.journal.fits(sum(map(len, records))):
            self._compact()  # rewrites the whole index (durably), these entries included
        else:
            self.journal.append(records, durable)

    def sync(self) -> None:
        """Make every block journalled so far durable: fdatasync the slab, then the journal."""
        if self._closed:
            raise KVTierError(f"file tier {self.name} is closed (close() already made everything durable)")
        self._sync()

    def _sync(self) -> None:
        with self._sync_lock:
            with self._jlock:
                self._dirty = False
                journal_fd = os.dup(self.journal.fd)  # a compaction may replace the journal meanwhile
            try:
                self.io.sync()
                os.fdatasync(journal_fd)
            except BaseException:
                self._dirty = True
                raise
            finally:
                os.close(journal_fd)

    def _sync_loop(self) -> None:
        """The background syncer: `sync()` every `sync_interval` seconds while there is news."""
        while not self._stop_syncer.wait(self.sync_interval):
            if self._dirty:
                try:
                    self._sync()
                except OSError as exc:  # retried next round; the blocks stay readable
                    log.warning("file tier %s: background fdatasync failed: %s", self.name, exc)

    def _commit_durable(self, entries: list[tuple[int, bytes, int]]) -> None:
        """Make this caller's (already written) slots durable, then journal them (group commit).

        Callers that finish their data writes while another caller is syncing queue up; the next
        leader covers all of them with one slab fdatasync and one journal append + fdatasync, so
        concurrent jobs do not each pay two journal commits of the filesystem.
        """
        mine = _PendingCommit(entries)
        with self._commit_cv:
            self._commit_queue.append(mine)
            while not mine.done and self._committing:
                self._commit_cv.wait()
            if mine.done:
                if mine.error is not None:
                    raise mine.error
                return
            self._committing = True
            batch, self._commit_queue = self._commit_queue, []
        error = None
        try:
            self.io.sync()
            with self._jlock:
                self._journal_entries([e for pending in batch for e in pending.entries], durable=True)
        except BaseException as exc:  # every caller of this batch fails with it
            error = exc
            with self._jlock:
                self._unindex([e for pending in batch for e in pending.entries])
        with self._commit_cv:
            for pending in batch:
                pending.done, pending.error = True, error
            self._committing = False
            self._commit_cv.notify_all()
        if error is not None:
            raise error

    def read_blocks(self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence) -> int:
        """Read and verify the blocks `keys[i]` in `slots[i]` into the writable `buffers[i]`."""
        views = self._check(slots, keys, buffers, writable=True)
        futures = [self._pool.submit(self._read_run, run, slots, keys, views) for run in self._runs(slots)]
        bad: list[tuple[int, str]] = []
        error = None
        for future in futures:
            try:
                bad.extend(future.result())
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        if bad:
            with self._jlock:
                for slot, _why in bad:
                    self._forget(slot)
            detail = "; ".join(f"slot {s}: {why}" for s, why in bad[:8])
            raise IntegrityError(f"file tier {self.name}: {len(bad)} block(s) in {self.slab_path} failed "
                                 f"verification and will not be served ({detail})")
        if error is not None:
            raise error
        return len(slots) * self.block_bytes

    def _check(self, slots, keys, buffers, writable: bool) -> list[memoryview]:
        if self._closed:
            raise KVTierError(f"file tier {self.name} is closed")
        if not len(slots) == len(keys) == len(buffers):
            raise ValueError(f"{len(slots)} slots, {len(keys)} keys and {len(buffers)} buffers: lengths must match")
        if len(set(slots)) != len(slots):
            raise ValueError(f"duplicate slots in {list(slots)}")
        views = []
        for slot, key, buf in zip(slots, keys, buffers):
            if not 0 <= slot < self.num_blocks:
                raise ValueError(f"slot {slot} out of range 0..{self.num_blocks - 1}")
            if len(key) > MAX_KEY_BYTES:
                raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
            view = memoryview(buf)
            if not view.c_contiguous:
                raise ValueError("buffers must be C-contiguous")
            view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            if view.nbytes != self.block_bytes:
                raise ValueError(f"buffer of {view.nbytes} bytes for a block of {self.block_bytes}")
            if writable and view.readonly:
                raise ValueError("read_blocks needs writable buffers")
            views.append(view)
        return views

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
        preadv/pwritev of header, payload, padding per slot): posix engine, writable buffers, and
        with O_DIRECT page-aligned ones of whole 4 KiB pages (the shared-memory CPU tier's slots)."""
        if not self._zero_copy_ok:
            return False
        if not self.io.direct:
            return True
        return all(not views[p].readonly and buffer_address(views[p]) % ALIGN == 0 for p in run)

    def _write_run(self, run: list[int], slots, keys, views) -> dict[int, int]:
        """Runs on the pool: write one run of adjacent slots (zero-copy or via a bounce buffer)."""
        buf = self._take_buffer()
        try:
            image = memoryview(buf)
            crcs = {}
            if self._zero_copy(run, views):
                iovs = []
                for i, pos in enumerate(run):
                    crc = payload_crc32(views[pos])
                    header = image[i * HEADER_BYTES:(i + 1) * HEADER_BYTES]
                    pack_header(header, keys[pos], self.block_bytes, crc, self.digest)
                    crcs[slots[pos]] = crc
                    iovs += [header, views[pos], self._pad] if self._pad else [header, views[pos]]
                try:
                    self.io.pwritev(slots[run[0]] * self.slot_bytes, iovs)
                    return crcs
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._no_zero_copy(exc)  # e.g. a 4 KiB-sector device refuses 512-byte iovecs
                crcs = {}
            for i, pos in enumerate(run):
                base = i * self.slot_bytes
                payload = image[base + HEADER_BYTES:base + HEADER_BYTES + self.block_bytes]
                payload[:] = views[pos]
                crc = payload_crc32(payload)
                pack_header(image[base:base + HEADER_BYTES], keys[pos], self.block_bytes, crc, self.digest)
                crcs[slots[pos]] = crc
            self.io.pwrite(slots[run[0]] * self.slot_bytes, image[:len(run) * self.slot_bytes])
            return crcs
        finally:
            self._buffers.put(buf)

    def _read_run(self, run: list[int], slots, keys, views) -> list[tuple[int, str]]:
        """Runs on the pool: read one run, verify each slot; a bad slot's buffer holds garbage and
        is reported (never served). Zero-copy when possible, else via a bounce buffer."""
        buf = self._take_buffer()
        try:
            image = memoryview(buf)
            offset, length = slots[run[0]] * self.slot_bytes, len(run) * self.slot_bytes
            if self._zero_copy(run, views):
                headers = [image[i * HEADER_BYTES:(i + 1) * HEADER_BYTES] for i in range(len(run))]
                iovs = []
                for header, pos in zip(headers, run):
                    iovs += [header, views[pos], self._pad_in] if self._pad else [header, views[pos]]
                try:
                    self.io.preadv(offset, iovs)
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        self._no_zero_copy(exc)
                    elif os.stat(self.slab_path).st_size < offset + length:
                        return [(slots[p], "slab truncated") for p in run]
                    else:
                        raise
                else:
                    return [(slots[pos], why) for header, pos in zip(headers, run)
                            if (why := verify_parts(header, views[pos], bytes(keys[pos]), self.block_bytes,
                                                    self.digest)) is not None]
            try:
                self.io.pread(offset, image[:length])
            except OSError:
                if os.stat(self.slab_path).st_size < offset + length:
                    return [(slots[p], "slab truncated") for p in run]
                raise
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

    def _no_zero_copy(self, exc: OSError) -> None:
        if self._zero_copy_ok:
            self._zero_copy_ok = False
            log.warning("file tier %s: scatter-gather O_DIRECT refused (%s); copying through bounce buffers",
                        self.name, exc)

    # ------------------------------------------------------------------ journal upkeep
    def _journal_capacity(self) -> int:
        """Size of a fresh journal file (see `journal_capacity`)."""
        return journal_capacity(self.num_blocks, self.compact_min_records)

    def _compact(self) -> None:
        """Rewrite the journal with the live entries only (caller holds `_jlock`)."""
        epoch = self.journal.epoch
        self.journal.close()
        entries = [(slot, key, crc) for slot, (key, crc, _s) in self._index.items()]
        self.journal = Journal.create(self.root / JOURNAL, epoch, entries, capacity=self._journal_capacity())
        self._pending_del = []

    def close(self) -> None:
        """Journal pending DELs, make everything durable (`sync`), close files, release the lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._stop_syncer.set()
        if self._syncer is not None:
            self._syncer.join()
        try:
            if self.journal is not None and self.journal.fd >= 0:
                with self._jlock:
                    self.journal.append([_record(_DEL, s) for s in self._pending_del], durable=False)
                    self._pending_del = []
                if self.io is not None:
                    self._sync()
        finally:
            if self.journal is not None:
                self.journal.close()
            if self.io is not None:
                self.io.close()
            while not self._buffers.empty():
                try:
                    self._buffers.get_nowait().close()
                except BufferError:  # still exported by a traceback's frame; freed with it
                    pass
            if self._lock_fd >= 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = -1

    def __repr__(self) -> str:
        return f"FileBackend({self.name!r}, {self.num_blocks} blocks of {self.block_bytes} B in {self.root})"
