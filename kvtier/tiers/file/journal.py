"""The file tier's journal: `root_dir/journal`, the index of committed slots.

A header (magic `KVTJ`, format version, the manifest's epoch) then append-only records
`PUT(slot, key, crc)` / `DEL(slot)`, each with its own CRC-32, written in place into a
zero-filled preallocated file (so an append + fdatasync changes no file metadata: no filesystem
journal commit). `scan_journal` replays it and stops at the first truncated or corrupt record;
`Journal` appends to it; `Journal.create` writes a fresh one (at a rebuild, or holding the live
entries only when it is compacted). How records reach it durably is `commit_log.py`'s job.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.tiers.file.fileio import read_regular_file
from kvtier.tiers.file.rootdir import open_existing, write_file_atomic
from kvtier.tiers.file.slot_format import FORMAT_VERSION, MAX_KEY_BYTES

JOURNAL_MAGIC = b"KVTJ"  # the first bytes of every journal (`kvtier clear` looks for them)
_JHDR = struct.Struct("<4sI16s")  # magic, version, epoch
# record crc, op, key_len, slot, payload crc; the key follows. The CRC covers everything after it.
_REC = struct.Struct("<IBxHQI")
PUT, DEL = 1, 2

Entry = tuple[int, bytes, int]  # (slot, key, payload crc) of a committed block


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
    past_end: int = 0  # live entries whose slot the slab file no longer holds (a cut slab): dropped

    def ignored(self) -> str | None:
        """What was ignored, for a warning or a report (None when nothing was)."""
        parts = []
        if self.beyond:
            parts.append(f"{self.beyond} journal records name slots beyond the slab")
        if self.bad_keys:
            parts.append(f"{self.bad_keys} journal records hold keys longer than {MAX_KEY_BYTES} bytes")
        if self.past_end:
            parts.append(f"{self.past_end} blocks lie past the end of a cut slab")
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
    if magic != JOURNAL_MAGIC or version != FORMAT_VERSION:
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
        if op not in (PUT, DEL):
            break
        if slot >= limit:
            scan.beyond += 1
        elif op == PUT and key_len > MAX_KEY_BYTES:
            scan.bad_keys += 1
        elif op == PUT:
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


def read_journal(path: Path, num_slots: int, capacity: int) -> JournalScan:
    """Replay the journal at `path`: a regular file no larger than a tier of `num_slots` slots
    (fresh journal files of `capacity` bytes) ever writes, read whole; records that cannot
    describe the slab are ignored (counted in the scan)."""
    try:
        data = read_regular_file(path, journal_max_bytes(num_slots, capacity))
    except OSError as exc:
        return JournalScan(problem=f"journal unreadable: {exc.strerror or exc}")
    return scan_journal(data, num_slots)


def record(op: int, slot: int, key: bytes = b"", crc: int = 0) -> bytes:
    """One journal record (`PUT` with the slot's key and payload CRC, or `DEL`)."""
    body = _REC.pack(0, op, len(key), slot, crc)[4:] + key
    return struct.pack("<I", zlib.crc32(body)) + body


def _count_records(data: bytes) -> int:
    count, pos = 0, 0
    while pos < len(data):
        _c, _op, key_len, _slot, _crc = _REC.unpack_from(data, pos)
        pos += _REC.size + key_len
        count += 1
    return count


class Journal:
    """An open journal file, appended to in place. Not thread-safe: `CommitLog` holds its lock."""

    def __init__(self, path: Path, epoch: bytes, pos: int, capacity: int, records: int = 0):
        self.path = path
        self.epoch = epoch
        self.pos = pos  # where the next record goes
        self.capacity = capacity
        self.records = records
        self.fd = open_existing(path, os.O_WRONLY)

    @classmethod
    def create(cls, path: Path, epoch: bytes, entries: Iterable[Entry] = (), capacity: int = 1 << 20) -> Journal:
        """Write a fresh journal holding `entries` (slot, key, crc) atomically, and open it.
        The file is `capacity` bytes, grown to twice what the entries need when they do not fit."""
        records = b"".join(record(PUT, slot, key, crc) for slot, key, crc in entries)
        used = _JHDR.size + len(records)
        capacity = max(capacity, 2 * used)
        header = _JHDR.pack(JOURNAL_MAGIC, FORMAT_VERSION, epoch)
        write_file_atomic(path, header + records + bytes(capacity - used))
        return cls(path, epoch, used, capacity, records=_count_records(records))

    @classmethod
    def reopen(cls, path: Path, scan: JournalScan) -> Journal:
        """Open the journal `scan` was read from, to append after its valid prefix."""
        return cls(path, scan.epoch or b"", scan.good_bytes, os.stat(path).st_size, scan.records)

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

    def compacted(self, entries: Iterable[Entry], capacity: int) -> Journal:
        """Close this journal and replace its file with a fresh one of the same epoch holding
        `entries` only (`capacity` bytes, see `create`); returns it open."""
        self.close()
        return Journal.create(self.path, self.epoch, entries, capacity=capacity)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
