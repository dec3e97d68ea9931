"""Whether the files under a file tier's names in a directory were written by a file tier.

`kvtier clear` removes them and a tier that rebuilds (a root_dir without our manifest) replaces
them; both must leave alone another program's `journal`, `manifest.json` or `slab.0` found in a
directory given by mistake. What a tier writes is recognisable: its journal starts with
`JOURNAL_MAGIC` (it is written whole, atomically), its manifest is a JSON object with the
geometry keys, and its slab is allocated zero-filled and holds slots that start with the slot
magic. Files are read at most a few bytes (the manifest: up to `MANIFEST_MAX_BYTES`), never
through a symlink, and only regular files (a FIFO is never opened for long).
"""

from __future__ import annotations

import json
import os
import stat

from kvtier.tiers.file.journal import JOURNAL_MAGIC
from kvtier.tiers.file.manifest import MANIFEST_MAX_BYTES
from kvtier.tiers.file.rootdir import JOURNAL, MANIFEST, SLAB
from kvtier.tiers.file.slot_format import SLOT_MAGIC

MANIFEST_KEYS = ("format_version", "slot_bytes", "num_slots", "fingerprint")  # every tier's manifest has them


def head(dir_fd: int, name: str, limit: int) -> bytes | None:
    """At most `limit` bytes of the regular file `name` in the directory `dir_fd` (None: no
    regular file of that name, or unreadable)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    finally:
        os.close(fd)


def holds_tier(dir_fd: int) -> bool:
    """Whether the directory holds a tier's journal or a tier's manifest (then its files under
    the tier's names are the tier's, whatever state they are in)."""
    if head(dir_fd, JOURNAL, len(JOURNAL_MAGIC)) == JOURNAL_MAGIC:
        return True
    data = head(dir_fd, MANIFEST, MANIFEST_MAX_BYTES + 1)
    if not data or len(data) > MANIFEST_MAX_BYTES:
        return False
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(manifest, dict) and all(key in manifest for key in MANIFEST_KEYS)


def foreign_files(dir_fd: int) -> list[str]:
    """The names among manifest.json, journal and slab.0 in the directory that hold what no tier
    wrote, in a directory that holds no tier (`holds_tier`): empty files, and a slab that starts
    with zeros or a slot (a first build interrupted before its journal), are a tier's leftovers."""
    if holds_tier(dir_fd):
        return []
    foreign = []
    for name in (MANIFEST, JOURNAL, SLAB):
        data = head(dir_fd, name, len(SLOT_MAGIC))
        if data is None or not data:
            continue
        if name == SLAB and data in (SLOT_MAGIC, bytes(len(SLOT_MAGIC))):
            continue
        foreign.append(name)
    return foreign
