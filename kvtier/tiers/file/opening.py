"""Opening a file tier's `root_dir`: from a path to a locked directory whose manifest, journal and
slab describe this tier, its committed blocks replayed from the journal.

`open_root` resolves `root_dir` (rootdir.py: created 0700 where missing, refused when unsafe),
takes the lock, and either trusts what it finds (manifest equal to the configuration, journal of
the manifest's epoch: the journal is replayed, a torn tail zeroed, records that cannot describe the
slab dropped by a compaction, a slab shorter than its geometry re-extended without the blocks past
its end), or refuses a manifest of another identity (fingerprint or layout: a
`root_dir` `ConfigError` that says how to keep or erase those blocks) unless the tier's
`on_identity_change` is `reset`, or logs one warning that the contents are not ours and rebuilds
the tier empty (new epoch): no manifest, another format version, another capacity, a journal that
does not match). A rebuild never replaces a `journal`, `slab.0` or `manifest.json` that no tier
wrote (`own_files.foreign_files`: another program's files in a root_dir given by mistake): refused.
No slot header is read: 100k blocks are ready in well under a second.

A build that fails removes the files and directories it created (`OpenedRoot.abandon` after a
later step failed) and gives a `root_dir` `ConfigError` for OS errors (`build_error`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.errors import KVTierError
from kvtier.core.units import format_size
from kvtier.tiers.file.fileio import ALIGN, file_kind
from kvtier.tiers.file.journal import Journal, JournalScan, read_journal
from kvtier.tiers.file.manifest import (
    identity_differences,
    load_manifest,
    manifest_differences,
    manifest_digest,
    manifest_epoch,
    wanted_manifest,
    write_manifest,
)
from kvtier.tiers.file.own_files import foreign_files
from kvtier.tiers.file.rootdir import (
    JOURNAL,
    MANIFEST,
    OWN_FILES,
    SLAB,
    TEMPORARIES,
    check_entries,
    open_or_create,
    prepare_root,
    refuse,
    remove_dirs,
    remove_file,
)
from kvtier.tiers.file.rootlock import RootLock

log = logging.getLogger("kvtier.tiers.file")  # the file tier's one logger (documented in tiers/file/backend.py)


@dataclass(frozen=True)
class TierShape:
    """What a file tier is configured to be: its name, geometry, identity and journal size."""

    name: str
    num_slots: int
    block_bytes: int
    slot_bytes: int
    fingerprint: str
    layout: str
    journal_capacity: int  # bytes of a fresh journal file
    on_identity_change: str = "refuse"  # or "reset": erase the blocks of another identity (see backend.py)

    @property
    def slab_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def manifest(self) -> dict:
        """The manifest this tier writes, without its epoch."""
        return wanted_manifest(self.block_bytes, self.slot_bytes, self.num_slots, self.fingerprint, self.layout)

    def no_space(self, root: Path, found: str) -> KVTierError:
        """The error for a `root_dir` without room for the slab and the journal."""
        return refuse(f"not enough free space in {root} for file tier {self.name!r}: its slab of "
                      f"{self.num_slots} blocks ({format_size(self.slab_bytes)}) and its journal "
                      f"({format_size(self.journal_capacity)}) are preallocated; {found}. Lower the tier's "
                      f"capacity or choose another root_dir")

    def build_error(self, root: Path, exc: OSError) -> KVTierError:
        """The `root_dir` error for an OS error met while building the tier."""
        if exc.errno == errno.ENOSPC:
            return self.no_space(root, f"{exc.strerror} while creating them")
        return refuse(f"file tier {self.name!r} cannot use {root}: {exc}")


@dataclass
class _Contents:
    """What the tier's files hold once opened (or rebuilt)."""

    manifest: dict
    journal: Journal
    entries: dict[int, tuple[bytes, int, int]]  # committed slot -> (key, crc, seq), in record order
    seq: int  # sequence number of the next record


class _Created:
    """The files and directories this build created: removed if it fails (none were there before)."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs
        self.files: list[Path] = []

    def remove(self) -> None:
        for path in reversed(self.files):
            remove_file(path)
        remove_dirs(self.dirs)


class OpenedRoot:
    """A tier's `root_dir`, locked, with its journal open and its committed blocks replayed."""

    def __init__(self, root: Path, lock: RootLock, created: _Created, contents: _Contents):
        self.root = root
        self.lock = lock
        self.slab_path = root / SLAB
        self.manifest = contents.manifest
        self.digest = manifest_digest(contents.manifest)
        self.journal = contents.journal
        self.entries = contents.entries
        self.seq = contents.seq
        self._created = created

    def abandon(self) -> None:
        """Undo the build after a later step failed: remove what it created (while the lock is
        held: nobody else is using these files), close the journal, release the lock."""
        try:
            self._created.remove()
            self.journal.close()
        finally:
            self.lock.release()


def open_root(root_dir: str, shape: TierShape) -> OpenedRoot:
    """Open (creating or rebuilding what is needed) the tier `shape` in `root_dir`. On failure
    nothing this call created is left behind; an OS error comes as a `root_dir` error
    (`TierShape.build_error`)."""
    try:
        root, created_dirs = prepare_root(str(Path(root_dir)))
    except OSError as exc:
        raise _as_build_error(shape, Path(root_dir), exc)  # noqa: B904 - it chains its cause itself, or is exc
    created = _Created(created_dirs)
    try:
        lock = RootLock(root)
    except BaseException as exc:
        created.remove()
        raise _as_build_error(shape, root, exc)  # noqa: B904 - it chains its cause itself, or is exc
    try:
        if lock.created:
            created.files.append(lock.path)
        present = check_entries(root, OWN_FILES)
        created.files += [root / n for n in OWN_FILES + TEMPORARIES if n not in present]
        contents = _open_contents(root, shape)
    except BaseException as exc:
        try:
            created.remove()
        finally:
            lock.release()
        raise _as_build_error(shape, root, exc)  # noqa: B904 - it chains its cause itself, or is exc
    return OpenedRoot(root, lock, created, contents)


def _as_build_error(shape: TierShape, root: Path, exc: BaseException) -> BaseException:
    """What to raise for `exc` met while building: OS errors as `root_dir` errors (chained)."""
    if isinstance(exc, OSError) and not isinstance(exc, KVTierError):
        error = shape.build_error(root, exc)
        error.__cause__ = exc
        return error
    return exc


def _open_contents(root: Path, shape: TierShape) -> _Contents:
    """Trust and replay the tier's files, or rebuild them empty (one warning when something was there)."""
    _refuse_foreign_slab(root / SLAB, shape.name)
    wanted = shape.manifest()
    found, unreadable = load_manifest(root)
    diffs = [f"no readable manifest: {unreadable}"] if unreadable else manifest_differences(found, wanted)
    if not diffs:
        assert found is not None  # no differences: a manifest was read
        scan = read_journal(root / JOURNAL, shape.num_slots, shape.journal_capacity)
        if scan.problem is None and scan.epoch != manifest_epoch(found):
            scan.problem = "journal belongs to another epoch"
        if scan.problem is None:
            return _replay(root, shape, found, scan)
        diffs = [scan.problem]
    elif shape.on_identity_change == "refuse":
        _refuse_other_identity(root, shape, identity_differences(found, wanted))
    _refuse_foreign_files(root, shape.name)
    if any(os.path.lexists(root / name) for name in (MANIFEST, SLAB)):
        log.warning("file tier %s: contents of %s are not ours (%s); starting empty", shape.name, root,
                    "; ".join(diffs))
    return _rebuild(root, shape, wanted)


def _refuse_foreign_files(root: Path, name: str) -> None:
    """Before a rebuild replaces them: refuse files under the tier's names that no tier wrote
    (another program's `journal` or `slab.0` in a root_dir given by mistake), in either
    `on_identity_change` mode."""
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        foreign = foreign_files(dir_fd)
    finally:
        os.close(dir_fd)
    if foreign:
        raise refuse(f"{root} holds {', '.join(foreign)} that file tier {name!r} did not write (no tier's "
                     f"manifest or journal is there); kvtier will not overwrite them. Give the tier a "
                     f"directory of its own, or move those files away")


def _refuse_other_identity(root: Path, shape: TierShape, diffs: list[str]) -> None:
    """Refuse to erase the blocks of another model or KV layout (`diffs`: how the manifest differs)."""
    if diffs:
        raise refuse(f"{root} holds the blocks of another model or KV layout ({'; '.join(diffs)}); file tier "
                     f"{shape.name!r} will not erase them. To keep them, give this configuration its own "
                     f"root_dir (one per model identity); to erase them on purpose, set "
                     f"'on_identity_change: reset' on this tier, or remove its files (kvtier clear {root} --yes)")


def _replay(root: Path, shape: TierShape, manifest: dict, scan: JournalScan) -> _Contents:
    """Our files: the journal's entries, its torn tail zeroed, impossible records compacted away."""
    _check_slab_size(root / SLAB, shape, scan)
    journal = Journal.reopen(root / JOURNAL, scan)
    try:
        if scan.torn_bytes:
            log.warning("file tier %s: ignoring a torn journal tail of %d bytes", shape.name, scan.torn_bytes)
            journal.zero_tail(scan.torn_bytes)
        if scan.ignored():
            log.warning("file tier %s: %s; rewriting the journal without them", shape.name, scan.ignored())
            entries = [(slot, key, crc) for slot, (key, crc, _s) in scan.entries.items()]
            journal = journal.compacted(entries, shape.journal_capacity)
    except BaseException:
        journal.close()
        raise
    return _Contents(manifest, journal, scan.entries, scan.records)


def _rebuild(root: Path, shape: TierShape, wanted: dict) -> _Contents:
    """Start empty: no manifest while the slab and journal are reset, then a new epoch."""
    _check_free_space(root, shape)
    remove_file(root / MANIFEST)
    _allocate_slab(root / SLAB, shape, truncate=True)
    epoch = uuid.uuid4().bytes
    journal = Journal.create(root / JOURNAL, epoch, capacity=shape.journal_capacity)
    manifest = {**wanted, "epoch": epoch.hex()}
    try:
        write_manifest(root, manifest)
    except BaseException:
        journal.close()
        raise
    return _Contents(manifest, journal, {}, 0)


def _refuse_foreign_slab(path: Path, name: str) -> None:
    """A slab path that exists but is not a regular file (a FIFO, a device, a symlink, a
    directory) was not made by kvtier: refuse it rather than block on it, write to it or remove it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise KVTierError(f"file tier {name}: {path} is not a regular file ({file_kind(mode)}); "
                          f"kvtier keeps its blocks in a regular file there: remove it or give the tier "
                          f"another root_dir")


def _check_free_space(root: Path, shape: TierShape) -> None:
    """Refuse before touching anything when the slab and the journal would not both fit (the
    old slab is truncated first; the old journal is replaced only after the new one is written)."""
    need = shape.slab_bytes + shape.journal_capacity + ALIGN  # + the manifest
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    try:
        reused = os.lstat(root / SLAB).st_blocks * 512
    except FileNotFoundError:
        reused = 0
    if need > free + reused:
        raise shape.no_space(root, f"{format_size(free)} free")


def _check_slab_size(path: Path, shape: TierShape, scan: JournalScan) -> None:
    """A slab shorter than its geometry lost the blocks past its end: forget them, re-extend."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = 0
    if size >= shape.slab_bytes:
        return
    lost = [s for s in scan.entries if (s + 1) * shape.slot_bytes > size]
    for slot in lost:
        del scan.entries[slot]
    scan.past_end = len(lost)  # (the journal is rewritten without them: they must not come back)
    log.warning("file tier %s: slab %s is %d bytes, expected %d; %d blocks past its end dropped",
                shape.name, path, size, shape.slab_bytes, len(lost))
    _allocate_slab(path, shape, truncate=False)


def _allocate_slab(path: Path, shape: TierShape, truncate: bool) -> None:
    fd, _created = open_or_create(path, os.O_RDWR)
    try:
        if truncate:
            os.ftruncate(fd, 0)
        try:
            os.posix_fallocate(fd, 0, shape.slab_bytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise shape.no_space(path.parent, f"{format_size(shape.slab_bytes)} could not be allocated") from exc
            os.ftruncate(fd, shape.slab_bytes)  # no fallocate on this filesystem: a sparse file
        os.fsync(fd)
    finally:
        os.close(fd)
