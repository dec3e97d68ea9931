"""`FileBackend`: blocks in a preallocated slab file under `root_dir` (the FILE medium).

On-disk layout of `root_dir` (directory 0700 when created here, files 0600):
- `lock`           flock'ed exclusively by the owning process, which writes its pid there.
- `manifest.json`  geometry, `fingerprint` (whose KV this is: the model identity, never empty),
                   `layout` (block geometry, dtypes and shapes) and a random `epoch` chosen at each
                   (re)build (manifest.py).
- `slab.0`         `num_slots` fixed slots of `slot_bytes` (a multiple of 4 KiB): a 4 KiB header
                   page (key, payload checksum and its kind, manifest digest, optional part
                   checksums), then the 4 KiB-aligned payload (slot_format.py), moved through a
                   `BlockIO` (slab.py, fileio.py).
- `journal`        append-only records `PUT(slot, key, crc)` / `DEL(slot)` (journal.py), replayed
                   at start and compacted when it grows. A PUT is appended once the slot's bytes
                   are written, so both survive a killed process; power-loss durability follows
                   `sync_interval` (0: slab then journal fdatasync'ed before `write_blocks` returns;
                   N > 0: every N seconds and at `sync()`/`close()`; commit_log.py). A PUT that
                   reaches the disk before its slot's bytes names a slot that fails verification
                   and is dropped. DELs ride along with the next append: a crash may bring back
                   evicted blocks that still verify.

Paths: `root_dir` and its files must be the user's and not writable by group/others, and nothing
in it is opened through a symlink (kvtier/tiers/file/rootdir.py); anything else is refused at build with
a `ConfigError` on `root_dir`, and a build that fails removes the files and directories it created.

Trust rules (opening.py): a manifest of another identity (`fingerprint` or `layout`, which names
the block geometry) is refused with a `root_dir` `ConfigError` naming both, so that no model's
blocks are erased by a reused config; option `on_identity_change: reset` (default `refuse`) erases
them instead. A manifest that differs otherwise (capacity, format version, none readable) or a
journal of another epoch means the contents are not ours: the tier starts empty and logs one warning
(never over a `journal` or `slab.0` that no tier wrote: refused, `own_files.py`). A block
is served only if its header (magic, version, manifest digest, key, length, header CRC) and payload
CRC verify; otherwise `read_blocks` raises `IntegrityError` and the block is forgotten. The
manifest and the journal are read only when they are regular files (not through a symlink: a FIFO
or /dev/zero is never read) no larger than this version writes (1 MiB; the journal's bound follows
from `num_slots`); otherwise they are not ours either. A journal record naming a slot past the slab
or a key no slot header can hold is ignored, with one warning counting them, and the journal is
rewritten without it.

All of the file tier's modules log to the logger `kvtier.tiers.file`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvtier.core.errors import ConfigError, KVTierError
from kvtier.core.identity import fingerprint_option
from kvtier.core.keys import OffloadKey
from kvtier.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.core.types import REQUIRED, BlockStatus
from kvtier.tiers import room
from kvtier.tiers.base import Backend
from kvtier.tiers.file.commit_log import CommitLog
from kvtier.tiers.file.direct import DirectPath
from kvtier.tiers.file.fileio import ALIGN, choose_io
from kvtier.tiers.file.journal import Journal, JournalScan, journal_capacity, journal_max_bytes, scan_journal
from kvtier.tiers.file.manifest import (
    MANIFEST_MAX_BYTES,
    load_manifest,
    manifest_differences,
    manifest_digest,
    read_manifest,
    wanted_manifest,
)
from kvtier.tiers.file.mounts import kernel_filesystem_problem
from kvtier.tiers.file.opening import OpenedRoot, TierShape, open_root
from kvtier.tiers.file.rootdir import (
    JOURNAL,
    LOCK,
    MANIFEST,
    OWN_FILES,
    SLAB,
    TEMPORARIES,
    TMP,
    expand_root_dir,
    inspect_root,
    refuse,
)
from kvtier.tiers.file.slab import RUN_BYTES, SlabIO, block_views
from kvtier.tiers.file.slot_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAX_KEY_BYTES,
    MAX_PARTS,
    SlotHeader,
    pack_header,
    parse_header,
    payload_crc32,
    slot_bytes_for,
    verify_parts,
    verify_slot,
)
from kvtier.tiers.file.spec import FileLoadStoreSpec

__all__ = [  # what other modules and tests import from here
    "ALIGN", "FORMAT_VERSION", "HEADER_BYTES", "JOURNAL", "LOCK", "MANIFEST", "MANIFEST_MAX_BYTES", "MAX_KEY_BYTES",
    "OWN_FILES", "RUN_BYTES", "SLAB", "TEMPORARIES", "TMP", "FileBackend", "Journal", "JournalScan", "SlotHeader",
    "journal_capacity", "journal_max_bytes", "load_manifest", "manifest_differences", "manifest_digest",
    "pack_header", "parse_header", "payload_crc32", "read_manifest", "scan_journal", "slot_bytes_for",
    "verify_parts", "verify_slot",
]


# ---------------------------------------------------------------------------- options
def _io(v) -> str:
    if v not in ("auto", "posix", "kvikio"):
        raise ValueError(f"{v!r} is not an I/O kind; use auto, posix or kvikio")
    return v


def _identity_change(v) -> str:
    if v not in ("refuse", "reset"):
        raise ValueError(f"{v!r} is not an answer to another identity's blocks in root_dir; use refuse (keep them: "
                         f"the open fails) or reset (erase them)")
    return v


def _sync_interval(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 3600:
        raise ValueError(f"expected seconds between background fdatasyncs from 0 (each store job durable "
                         f"before it completes) to 3600, got {v!r}")
    return float(v)


def _part_checks(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_PARTS:
        raise ValueError(f"expected the number of equal parts a block is checksummed in, from 1 (the whole "
                         f"block) to {MAX_PARTS}, got {v!r}")
    return v


def _threads(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 256:
        raise ValueError(f"expected a number of I/O threads between 1 and 256, got {v!r}")
    return v


def _layout(layout: str, block_bytes: int, block_size: int) -> str:
    """What decides the bytes of a block besides the model: the builder's description, or the
    geometry this tier knows (the same text `describe_layout` gives without KV caches)."""
    return layout or f"block_bytes={block_bytes} block_tokens={block_size}"


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
    handlers = (
        (CPULoadStoreSpec, FileLoadStoreSpec, "kvtier.transfer.handlers.cpu_file:make_cpu_to_file"),
        (FileLoadStoreSpec, CPULoadStoreSpec, "kvtier.transfer.handlers.cpu_file:make_file_to_cpu"),
        (GPULoadStoreSpec, FileLoadStoreSpec, "kvtier.transfer.handlers.gpu_file:make_gpu_to_file"),
        (FileLoadStoreSpec, GPULoadStoreSpec, "kvtier.transfer.handlers.gpu_file:make_file_to_gpu"),
    )
    max_key_bytes = MAX_KEY_BYTES  # what a slot header leaves for the key
    max_blocks = None  # slot numbers are 64-bit; bounded by the disk (capacity_problem)
    persistent = True
    compact_min_records = 4096  # the journal is rewritten past max(this, 2 x capacity) records
    OPTIONS = {
        "root_dir": (REQUIRED, expand_root_dir),  # `~` and `$VAR`s expanded; what cannot be one is refused
        "io": ("auto", _io),
        "fingerprint": ("", fingerprint_option),
        "num_threads": (4, _threads),
        "sync_interval": (1.0, _sync_interval),
        "on_identity_change": ("refuse", _identity_change),
        # Slots also carry a checksum of each of N equal parts (one per tensor-parallel rank under
        # vLLM, which sets it), so that a reader of one part verifies exactly its bytes.
        "part_checks": (1, _part_checks),
    }

    @classmethod
    def check_environment(cls, options: dict) -> tuple[list[str], list[tuple[str, str]]]:
        """Whether `root_dir` passes the opening checks here (`rootdir.inspect_root`)."""
        try:
            return [f"root_dir {inspect_root(options['root_dir'])}"], []
        except ConfigError as exc:
            return [], list(exc.problems)

    @classmethod
    def expected_manifest(cls, num_blocks: int, block_bytes: int, block_size: int, options: Mapping[str, Any]) -> dict:
        """The manifest (without its epoch) that a tier built with these arguments writes: what a
        process reading it without owning it checks it against (`kvtier.tiers.file.reader`)."""
        return wanted_manifest(block_bytes, slot_bytes_for(block_bytes), num_blocks, str(options["fingerprint"]),
                               _layout(str(options.get("layout") or ""), block_bytes, block_size))

    @classmethod
    def capacity_problem(cls, need_bytes: int, options: Mapping[str, Any]) -> str | None:
        """The slab must fit on the filesystem of `root_dir` (what the directory holds counts as room);
        not asked of a kernel filesystem (no room to count: `root_dir` itself is refused)."""
        root = options.get("root_dir")
        if isinstance(root, str) and kernel_filesystem_problem(root):
            return None
        return room.disk_problem(need_bytes, root)

    def __init__(self, name: str, num_blocks: int, block_bytes: int, block_size: int = 0, *,
                 root_dir: str, io: str = "auto", fingerprint: str = "", num_threads: int = 4,
                 sync_interval: float = 1.0, layout: str = "", on_identity_change: str = "refuse",
                 part_checks: int = 1):
        super().__init__(name, num_blocks, block_bytes, block_size)
        if block_bytes <= 0:
            raise ValueError(f"file tier {name!r} needs block_bytes > 0, got {block_bytes}")
        if block_bytes % _part_checks(part_checks):
            raise ConfigError([("part_checks", f"{part_checks} does not divide the blocks of {block_bytes} bytes of "
                                               f"file tier {name!r} into equal parts")])
        self.part_checks = part_checks
        _io(io), fingerprint_option(fingerprint), _threads(num_threads), _identity_change(on_identity_change)
        if not fingerprint:
            raise ConfigError([("fingerprint", f"empty: file tier {name!r} keeps blocks across restarts and must "
                                               f"not serve them to another model; give the identity of the model "
                                               f"whose KV it holds, e.g. 'meta-llama/Llama-3.1-8B@<revision>'")])
        self.layout = _layout(layout, block_bytes, block_size)
        self.sync_interval = _sync_interval(sync_interval)
        try:
            root_dir = expand_root_dir(root_dir)
        except ValueError as exc:
            raise refuse(str(exc)) from None
        self.slot_bytes = slot_bytes_for(block_bytes)
        self.num_threads = num_threads
        self.io_option = io  # as configured: the engine <-> file path honours an explicit kvikio
        shape = TierShape(name, num_blocks, block_bytes, self.slot_bytes, fingerprint, self.layout,
                          journal_capacity(num_blocks, self.compact_min_records), on_identity_change)
        opened = open_root(root_dir, shape)
        self.root = opened.root
        self.slab_path = opened.slab_path
        self.manifest = opened.manifest
        self.digest = opened.digest
        self._lock = opened.lock
        self._closed = False
        self._recovered = False
        self._slab, self._commits = self._start(opened, shape, io)
        # The direct (device) path: kvtier/transfer/handlers/gpu_file.py moves payloads itself (direct.py).
        self.direct_path = DirectPath(name, num_blocks, self.slot_bytes, self.slab_path, self._slab, self._commits,
                                      is_closed=lambda: self._closed)

    def _start(self, opened: OpenedRoot, shape: TierShape, io: str) -> tuple[SlabIO, CommitLog]:
        """The slab I/O and the commit log over an opened root_dir (abandoned if they fail)."""
        try:
            block_io = choose_io(io, str(opened.slab_path), self.num_threads, tier=self.name)
            try:
                slab = SlabIO(self.name, block_io, opened.slab_path, self.block_bytes, self.slot_bytes, opened.digest,
                              self.num_threads, self.part_checks)
            except BaseException:
                block_io.close()
                raise
            try:
                commits = CommitLog(self.name, opened.journal, opened.entries, opened.seq, num_slots=self.num_blocks,
                                    capacity=shape.journal_capacity, compact_min_records=self.compact_min_records,
                                    sync_slab=slab.sync, sync_interval=self.sync_interval)
            except BaseException:
                slab.close()
                raise
        except BaseException as exc:
            opened.abandon()
            if isinstance(exc, OSError) and not isinstance(exc, KVTierError):
                raise shape.build_error(opened.root, exc) from exc
            raise
        return slab, commits

    @property
    def io(self):
        """The `BlockIO` on the slab (fileio.py): `name` is "posix" or "kvikio", `direct` O_DIRECT."""
        return self._slab.io

    @property
    def journal(self) -> Journal:
        """The open journal (replaced by each compaction): `records` counts its records."""
        return self._commits.journal

    @property
    def unsynced(self) -> bool:
        """Whether blocks journalled since the last sync still wait for their fdatasync."""
        return self._commits.dirty

    # ------------------------------------------------------------------ Backend API
    def recover(self) -> list[tuple[OffloadKey, BlockStatus]]:
        """Committed blocks from the journal (ready, slots claimed); a key found in several slots
        keeps its latest copy. Slot headers are not read here: bad blocks are dropped at read time."""
        if self._recovered:
            return []
        self._recovered = True
        found = []
        latest = self._commits.latest()
        for slot in sorted(latest):
            self.slots.claim(slot)
            block = BlockStatus(slot)
            block.ref_cnt = 0
            found.append((OffloadKey(latest[slot]), block))
        return found

    def free(self, block: BlockStatus) -> None:
        super().free(block)
        self._commits.forget([block.block_id])

    def still_valid(self, block: BlockStatus) -> bool:
        """A block survives a failed read unless verification forgot it (bad header or checksum)."""
        return self._commits.holds(block.block_id)

    def get_load_store_spec(self, keys: Iterable[OffloadKey], blocks: Iterable[BlockStatus]) -> FileLoadStoreSpec:
        return FileLoadStoreSpec([b.block_id for b in blocks], list(keys), tier=self.name)

    def committed(self) -> dict[int, bytes]:
        """slot -> key of every committed block (a snapshot)."""
        return self._commits.snapshot()

    # ------------------------------------------------------------------ byte API
    def write_blocks(self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence) -> int:
        """Write `buffers[i]` (block_bytes, C-contiguous) as the block `keys[i]` into `slots[i]`."""
        views = self._views(slots, keys, buffers, writable=False)
        crcs = self._slab.write(slots, keys, views)
        self._commits.commit([(slot, bytes(key), crcs[slot]) for slot, key in zip(slots, keys)])
        return len(slots) * self.block_bytes

    def read_blocks(self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence) -> int:
        """Read and verify the blocks `keys[i]` in `slots[i]` into the writable `buffers[i]`. Blocks
        that fail verification are forgotten (never served again) and raise `IntegrityError`
        naming their `slots`: every other buffer then holds its block, verified. An I/O error
        raises itself (no buffer is to be trusted)."""
        views = self._views(slots, keys, buffers, writable=True)
        bad, error = self._slab.read(slots, keys, views)
        rejected = self.direct_path.reject(bad) if bad else None
        if error is not None:
            raise error
        if rejected is not None:
            raise rejected
        return len(slots) * self.block_bytes

    def _views(self, slots, keys, buffers, writable: bool) -> list[memoryview]:
        if self._closed:
            raise KVTierError(f"file tier {self.name} is closed")
        return block_views(slots, keys, buffers, self.num_blocks, self.block_bytes, writable)

    def sync(self) -> None:
        """Make every block journalled so far durable: fdatasync the slab, then the journal."""
        if self._closed:
            raise KVTierError(f"file tier {self.name} is closed (close() already made everything durable)")
        self._commits.sync()

    def close(self) -> None:
        """Journal pending DELs, make everything durable (`sync`), close files, release the lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        clean = False
        try:
            self._slab.drain()
            self._commits.close()
            clean = True
        finally:
            try:
                self._slab.close()
            finally:
                self._lock.release(clean=clean)

    def __repr__(self) -> str:
        return f"FileBackend({self.name!r}, {self.num_blocks} blocks of {self.block_bytes} B in {self.root})"
