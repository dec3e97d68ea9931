"""Which slots of the file tier hold committed blocks, and how their records reach the journal.

`CommitLog` keeps the index (slot -> key, payload CRC, sequence number, in record order) and
appends to the `Journal` (journal.py): a PUT once the slot's bytes are written, so both survive a
killed process; the DELs of forgotten slots ride along with the next append (losing them in a
crash only brings back blocks that still verify). Past max(`compact_min_records`, 2 x slots)
records, or when the journal file is full, the journal is rewritten with the live entries only.

Power-loss durability follows `sync_interval`:
- 0 (`_GroupCommit`): before `commit` returns, the slab is fdatasync'ed, then the journal;
  concurrent callers share one of each (group commit).
- N > 0 (`_BackgroundSync`): `commit` journals at once; a background thread makes everything
  durable every N seconds while there is news (and `sync()` / `close()` on demand).
A PUT that reaches the disk before its slot's bytes is harmless: the slot then fails
verification and is dropped.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from kvtier.tiers.file.journal import DEL, PUT, Entry, Journal, record

log = logging.getLogger("kvtier.tiers.file")  # the file tier's one logger (documented in tiers/file/backend.py)


class CommitLog:
    """The index of committed slots and its journal. Thread-safe."""

    def __init__(self, name: str, journal: Journal, entries: dict[int, tuple[bytes, int, int]], seq: int, *,
                 num_slots: int, capacity: int, compact_min_records: int, sync_slab: Callable[[], None],
                 sync_interval: float):
        """Take over `journal` (open, holding `entries` slot -> (key, crc, seq) and `seq` records).
        `sync_slab()` makes the slab's completed writes durable; `capacity` is the size of a fresh
        journal file. With `sync_interval` > 0 the background syncer starts here."""
        self.name = name
        self.journal = journal
        self.num_slots = num_slots
        self.capacity = capacity
        self.compact_min_records = compact_min_records
        self._index = entries
        self._seq = seq
        self._pending_del: list[int] = []
        self._lock = threading.Lock()
        self._sync_slab = sync_slab
        self._sync_lock = threading.Lock()
        self._dirty = False  # journalled since the last sync (sync_interval > 0)
        self._mode: _GroupCommit | _BackgroundSync = (
            _GroupCommit(self) if sync_interval == 0 else _BackgroundSync(self, sync_interval))

    # ------------------------------------------------------------------ the index
    def holds(self, slot: int) -> bool:
        with self._lock:
            return slot in self._index

    def snapshot(self) -> dict[int, bytes]:
        """slot -> key of every committed block."""
        with self._lock:
            return {slot: key for slot, (key, _c, _s) in self._index.items()}

    def forget(self, slots) -> None:
        """Drop slots from the index; their DEL records go out with the next journal append."""
        with self._lock:
            for slot in slots:
                if self._index.pop(slot, None) is not None:
                    self._pending_del.append(slot)

    def latest(self) -> dict[int, bytes]:
        """slot -> key of the committed blocks, a key found in several slots keeping its latest
        copy (the others are forgotten)."""
        with self._lock:
            latest: dict[bytes, int] = {}
            stale = []
            for slot, (key, _crc, _seq) in self._index.items():  # record order: later wins
                old = latest.get(key)
                if old is not None:
                    stale.append(old)
                latest[key] = slot
        self.forget(stale)
        return {slot: key for key, slot in latest.items()}

    @property
    def dirty(self) -> bool:
        """Whether blocks journalled since the last sync are not yet durable (`sync_interval` > 0)."""
        return self._dirty

    # ------------------------------------------------------------------ committing
    def commit(self, entries: list[Entry]) -> None:
        """Journal these (already written) slots, durably first when `sync_interval` is 0. On
        failure they are not in the index (their old contents are gone too)."""
        self._mode.commit(entries)

    def _append(self, entries: list[Entry], durable: bool) -> None:
        """Index `entries` and append their PUTs (after the pending DELs) to the journal, or
        compact it (caller holds `_lock`)."""
        records = [record(DEL, s) for s in self._pending_del]
        self._pending_del = []
        records.extend(record(PUT, slot, key, crc) for slot, key, crc in entries)
        for slot, key, crc in entries:
            self._index.pop(slot, None)
            self._index[slot] = (key, crc, self._seq)
            self._seq += 1
        too_many = self.journal.records + len(records) > max(self.compact_min_records, 2 * self.num_slots)
        if too_many or not self.journal.fits(sum(map(len, records))):
            self._compact()  # rewrites the whole index (durably), these entries included
        else:
            self.journal.append(records, durable)

    def _journal(self, entries: list[Entry], durable: bool) -> None:
        """`_append` under the lock; on failure the slots leave the index (`_unindex`). Not
        durable: marks the log dirty (the syncer's news)."""
        with self._lock:
            try:
                self._append(entries, durable)
            except BaseException:
                self._unindex(entries)
                raise
            if not durable:
                self._dirty = True

    def _drop(self, entries: list[Entry]) -> None:
        """`_unindex` under the lock."""
        with self._lock:
            self._unindex(entries)

    def _unindex(self, entries: list[Entry]) -> None:
        """Forget slots whose new contents did not reach the journal (or, with `sync_interval` 0,
        were not made durable): their old index entries are stale too (caller holds `_lock`)."""
        for slot, _key, _crc in entries:
            self._index.pop(slot, None)

    def _compact(self) -> None:
        """Rewrite the journal with the live entries only (caller holds `_lock`)."""
        entries = [(slot, key, crc) for slot, (key, crc, _s) in self._index.items()]
        self.journal = self.journal.compacted(entries, self.capacity)
        self._pending_del = []

    # ------------------------------------------------------------------ durability
    def sync(self) -> None:
        """Make every block journalled so far durable: fdatasync the slab, then the journal."""
        with self._sync_lock:
            with self._lock:
                self._dirty = False
                journal_fd = os.dup(self.journal.fd)  # a compaction may replace the journal meanwhile
            try:
                self._sync_slab()
                os.fdatasync(journal_fd)
            except BaseException:
                self._dirty = True
                raise
            finally:
                os.close(journal_fd)

    def close(self) -> None:
        """Stop the syncer, journal pending DELs, make everything durable, close the journal."""
        self._mode.close()
        try:
            if self.journal.fd >= 0:
                with self._lock:
                    self.journal.append([record(DEL, s) for s in self._pending_del], durable=False)
                    self._pending_del = []
                self.sync()
        finally:
            self.journal.close()


class _PendingCommit:
    """One caller waiting for its group commit."""

    __slots__ = ("entries", "done", "error")

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        self.done = False
        self.error: BaseException | None = None


class _GroupCommit:
    """`sync_interval` 0: each caller's slots are durable before `commit` returns.

    Callers that finish their data writes while another caller is syncing queue up; the next
    leader covers all of them with one slab fdatasync and one journal append + fdatasync, so
    concurrent jobs do not each pay two journal commits of the filesystem."""

    def __init__(self, log_: CommitLog):
        self._log = log_
        self._cv = threading.Condition()
        self._queue: list[_PendingCommit] = []
        self._committing = False

    def commit(self, entries: list[Entry]) -> None:
        mine = _PendingCommit(entries)
        with self._cv:
            self._queue.append(mine)
            while not mine.done and self._committing:
                self._cv.wait()
            if mine.done:
                if mine.error is not None:
                    raise mine.error
                return
            self._committing = True
            batch, self._queue = self._queue, []
        error = None
        entries = [e for pending in batch for e in pending.entries]
        try:
            self._log._sync_slab()
        except BaseException as exc:  # every caller of this batch fails with it
            error = exc
            self._log._drop(entries)
        else:
            try:
                self._log._journal(entries, durable=True)
            except BaseException as exc:
                error = exc
        with self._cv:
            for pending in batch:
                pending.done, pending.error = True, error
            self._committing = False
            self._cv.notify_all()
        if error is not None:
            raise error

    def close(self) -> None:
        pass


class _BackgroundSync:
    """`sync_interval` > 0: `commit` journals at once; a thread syncs every `interval` seconds
    while there is news (a failed sync is retried the next round; the blocks stay readable)."""

    def __init__(self, log_: CommitLog, interval: float):
        self._log = log_
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvtier-sync-{log_.name}", daemon=True)
        self._thread.start()

    def commit(self, entries: list[Entry]) -> None:
        self._log._journal(entries, durable=False)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            if self._log.dirty:
                try:
                    self._log.sync()
                except OSError as exc:
                    log.warning("file tier %s: background fdatasync failed: %s", self._log.name, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
