"""Read-only report on a file tier's `root_dir` (for `kvtier inspect`).

Opens every file read-only and takes no lock, so it works while a running process owns the tier;
what it reports is a snapshot (a concurrent writer may append to the journal meanwhile). Only
regular files are opened (never through a symlink, never blocking on a FIFO) and metadata reads
are bounded, so a hostile root_dir is reported, not followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from kvtier.tiers.file.backend import FileBackend
from kvtier.tiers.file.fileio import file_kind, open_regular_file, read_regular_file
from kvtier.tiers.file.journal import journal_capacity, journal_max_bytes, scan_journal
from kvtier.tiers.file.manifest import load_manifest, manifest_digest, version_difference
from kvtier.tiers.file.rootdir import JOURNAL, LOCK, OWN_FILES, SLAB
from kvtier.tiers.file.slot_format import FORMAT_VERSION, HEADER_BYTES, slot_bytes_for, verify_slot
from kvtier.tiers.owners import pid_alive

PROC_LOCKS = "/proc/locks"  # the kernel's table of held locks (tests point it at a copy)
_JOURNAL_LIMIT_WITHOUT_GEOMETRY = 1 << 30  # no trusted num_slots to size the bound with


def _geometry_problem(manifest: dict) -> str | None:
    """Why a manifest's geometry cannot describe a slab written by this version, or None."""
    names = ("format_version", "block_bytes", "slot_bytes", "header_bytes", "num_slots")
    values: dict[str, Any] = {k: manifest.get(k) for k in names}
    bad = [f"{k}={v!r}" for k, v in values.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
    if bad:
        return "manifest geometry invalid (" + ", ".join(bad) + ")"
    if values["format_version"] != FORMAT_VERSION:
        return version_difference(values["format_version"])
    if values["header_bytes"] != HEADER_BYTES or values["slot_bytes"] != slot_bytes_for(values["block_bytes"]):
        return (f"manifest geometry inconsistent (slot_bytes {values['slot_bytes']}, header_bytes "
                f"{values['header_bytes']} for blocks of {values['block_bytes']} bytes)")
    return None


def _lock_holder(root: Path) -> tuple[dict, str]:
    """({pid, alive}, the state in words) of the tier's lock, read-only (no lock is taken). The
    pid is the one written in the lock file: erased by a clean close, left by a process that died
    holding the tier. Whether a process holds the lock now comes from /proc/locks where readable."""
    try:
        text = read_regular_file(root / LOCK, 64).decode(errors="replace").strip()
    except FileNotFoundError:
        return {"pid": None, "alive": False}, "not open (no lock file: never opened)"
    except OSError as exc:
        return {"pid": None, "alive": False}, f"unknown (lock file unreadable: {exc.strerror or exc})"
    pid = int(text) if text.isdigit() else None
    alive = pid is not None and pid_alive(pid)
    holders = _flock_holders(root / LOCK)
    holder = {"pid": pid, "alive": alive}
    if pid is None:
        if holders:
            return holder, f"open (process {holders[0]} is opening it)"
        return holder, "not open (closed cleanly)" if not text else f"unknown (lock file holds {text[:32]!r})"
    if not alive:
        return holder, (f"not open: stale lock of process {pid}, which ended without closing the tier (killed or "
                        f"crashed); the next start takes it over")
    if holders is not None and pid not in holders:
        return holder, f"not open (process {pid}, which opened it last, no longer holds it)"
    return holder, f"open by process {pid}"


def _flock_holders(path: Path) -> list[int] | None:
    """The pids holding a flock on `path` (from /proc/locks), or None where that cannot be read.

    A lock is matched by inode number only: /proc/locks names the filesystem by its superblock's
    device, which is not the `st_dev` that stat reports on btrfs (a device per subvolume)."""
    try:
        st = os.lstat(path)
        with open(PROC_LOCKS) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    pids = []
    for line in lines:
        fields = line.split()
        if (len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(st.st_ino)
                and fields[4].isdigit()):
            pids.append(int(fields[4]))
    return pids


def inspect_root(root_dir: str, verify: bool = False) -> dict:
    """What the file tier in `root_dir` holds.

    Keys: root_dir, manifest (dict or None), fingerprint, block_bytes, slot_bytes, num_slots,
    blocks (committed blocks in the journal), bytes (their payload bytes), slab_bytes (file size),
    journal_records, journal_torn_bytes, index_health ("ok" or what is wrong), lock_holder ({pid, alive}:
    the pid in the lock file, None after a clean close), lock (open, closed cleanly, or a stale lock
    of a process that died, in words), is_tier (whether any of the tier's own files is there);
    with `verify`, also verified_ok and verify_failed (blocks whose header/checksum fail) and
    failures (up to 20 `{key, slot, reason}`: the key in hex, as stored), plus verify_error when
    what verification needs could not be read: the slab (missing, or not a regular file), or a
    journal that is there but unreadable (no permission, not a regular file, larger than any
    journal, an I/O error: its blocks are unknown, so none was verified), naming the file and why.
    A missing journal is no error: the tier holds no committed block. Never modifies anything.
    """
    root = Path(root_dir)
    report: dict = {"root_dir": str(root), "is_tier": any(os.path.lexists(root / name) for name in OWN_FILES)}
    manifest, unreadable = load_manifest(root)
    report["manifest"] = manifest
    report["fingerprint"] = manifest.get("fingerprint") if manifest else None
    for key in ("block_bytes", "slot_bytes", "num_slots"):
        report[key] = manifest.get(key) if manifest else None
    slab = root / SLAB
    report["slab_bytes"], slab_problem = _slab_size(slab)
    health = []
    if manifest is None:
        health.append(f"no readable manifest: {unreadable} (the next start rebuilds the tier empty)")
    elif (geometry := _geometry_problem(manifest)) is not None:
        health.append(f"{geometry} (the next start rebuilds the tier empty)")
        manifest = None  # nothing below can be located with it
    if slab_problem:
        health.append(slab_problem)
    scan, entries, journal_error = _journal_health(root, manifest, report["slot_bytes"] or 0, report["slab_bytes"],
                                                   health)
    report["blocks"] = len(entries)
    report["bytes"] = len(entries) * (report["block_bytes"] or 0)
    report["journal_records"] = scan.records if scan else 0
    report["journal_torn_bytes"] = scan.torn_bytes if scan else 0
    report["index_health"] = "; ".join(health) if health else "ok"
    report["lock_holder"], report["lock"] = _lock_holder(root)
    if verify:
        report.update(_verify(slab, manifest, entries))
        if journal_error:
            report["verify_error"] = "; ".join(e for e in (journal_error, report.get("verify_error")) if e)
    return report


def _journal_health(root: Path, manifest: dict | None, slot_bytes: int, slab_bytes: int | None,
                    health: list[str]) -> tuple[Any, dict, str | None]:
    """(the journal's scan or None, its committed entries: slot -> (key, check, ...), why a journal
    that is there could not be read or None), appending to `health` what is wrong with the journal
    as `manifest` (None: unusable) describes the tier."""
    scan, problem, unreadable = _scan(root, manifest["num_slots"] if manifest is not None else None)
    if problem:
        health.append(problem)
    elif manifest is not None and scan.epoch.hex() != manifest.get("epoch"):
        health.append("journal belongs to another epoch than the manifest (the next start rebuilds)")
    entries = scan.entries if scan and not problem else {}
    if scan and scan.ignored():
        health.append(scan.ignored())
    if scan and scan.torn_bytes:
        health.append(f"torn journal tail of {scan.torn_bytes} bytes (ignored at start)")
    keys = [key for key, _c, _s in entries.values()]
    duplicates = len(keys) - len(set(keys))
    if duplicates:
        health.append(f"{duplicates} keys committed in more than one slot (the latest wins)")
    if manifest is not None and slab_bytes is not None:
        beyond = [s for s in entries if (s + 1) * slot_bytes > slab_bytes]
        if beyond:
            health.append(f"slab truncated: {len(beyond)} blocks past its end")
    return scan, entries, unreadable


def _slab_size(slab: Path) -> tuple[int | None, str | None]:
    """(size of the slab file or None, why it is unusable or None); a symlink is not followed."""
    try:
        st = os.lstat(slab)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{SLAB}: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{SLAB}: not a regular file ({file_kind(st.st_mode)})"
    return st.st_size, None


def _scan(root: Path, num_slots: int | None):
    """(JournalScan or None, why the journal is unusable or None, why a journal that is there could
    not be read or None: the path and the OS's reason). The journal is read only if it is a
    regular file no larger than a tier of `num_slots` slots ever writes."""
    limit = _JOURNAL_LIMIT_WITHOUT_GEOMETRY
    if num_slots is not None:
        limit = journal_max_bytes(num_slots, journal_capacity(num_slots, FileBackend.compact_min_records))
    try:
        scan = scan_journal(read_regular_file(root / JOURNAL, limit), num_slots)
    except OSError as exc:
        why = exc.strerror or str(exc)
        unreadable = None if isinstance(exc, FileNotFoundError) else (
            f"{root / JOURNAL} could not be read ({why}): the blocks it commits are unknown, none was verified")
        return None, f"journal unreadable: {why}", unreadable
    return scan, scan.problem, None


def _verify(slab: Path, manifest: dict | None, entries: dict) -> dict:
    """Read every committed slot and check it as `read_blocks` would. A slab that is missing or
    not a regular file verifies nothing (`verify_error` says why); it is never read or waited on."""
    if manifest is None or not entries:
        return {"verified_ok": 0, "verify_failed": len(entries), "failures": []}
    digest = manifest_digest(manifest)
    block_bytes, slot_bytes = manifest["block_bytes"], manifest["slot_bytes"]
    ok, failures = 0, []
    try:
        fd = open_regular_file(slab)
    except OSError as exc:
        return {"verified_ok": 0, "verify_failed": len(entries), "failures": [],
                "verify_error": f"{SLAB}: {exc.strerror or exc}"}
    try:
        size = os.fstat(fd).st_size
        for slot in sorted(entries):
            key = entries[slot][0]
            why: str | None
            if (slot + 1) * slot_bytes > size:  # not read: a hostile geometry cannot make it allocate
                why = "slab truncated"
            else:
                data = os.pread(fd, slot_bytes, slot * slot_bytes)
                why = "slab truncated" if len(data) < slot_bytes else verify_slot(memoryview(data), key, block_bytes,
                                                                                  digest)
            if why is None:
                ok += 1
            else:
                failures.append({"key": key.hex(), "slot": slot, "reason": why})
    finally:
        os.close(fd)
    return {"verified_ok": ok, "verify_failed": len(failures), "failures": failures[:20]}
