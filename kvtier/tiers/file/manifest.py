"""The file tier's manifest: `root_dir/manifest.json`, which says whose blocks the slab holds.

It records the geometry (format version, block_bytes, slot_bytes, header_bytes, num_slots), the
`fingerprint` (the model identity, never empty), the `layout` (block geometry, dtypes and shapes,
from the builder) and a random `epoch` chosen at each (re)build. Its digest (`manifest_digest`) is
stamped into every slot header, so a slot written under another manifest never verifies. A
manifest whose geometry differs from the configuration (`manifest_differences`) means the
contents are not ours.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvtier.tiers.file.fileio import read_regular_file
from kvtier.tiers.file.rootdir import MANIFEST, SLAB, write_file_atomic
from kvtier.tiers.file.slot_format import FORMAT_VERSION, HEADER_BYTES

MANIFEST_MAX_BYTES = 1 << 20  # a manifest is a few hundred bytes: anything this big is not one
GEOMETRY = ("format_version", "block_bytes", "slot_bytes", "header_bytes", "num_slots", "fingerprint", "layout")
# Whose blocks these are and how they decode: a manifest differing in one of these holds another
# model's (or layout's) KV, which a tier refuses to erase unless told to (`on_identity_change`).
IDENTITY = ("fingerprint", "layout")  # (the layout names the block geometry too)


def wanted_manifest(block_bytes: int, slot_bytes: int, num_slots: int, fingerprint: str, layout: str) -> dict:
    """The manifest a tier of this geometry and identity writes (without its epoch)."""
    return {"format_version": FORMAT_VERSION, "block_bytes": block_bytes, "slot_bytes": slot_bytes,
            "header_bytes": HEADER_BYTES, "num_slots": num_slots, "fingerprint": fingerprint,
            "layout": layout, "slab": SLAB}


def manifest_digest(manifest: dict) -> bytes:
    """8-byte digest of a manifest (epoch included), stamped into every slot header."""
    return hashlib.blake2b(json.dumps(manifest, sort_keys=True).encode(), digest_size=8).digest()


def manifest_epoch(manifest: dict) -> bytes | None:
    """The epoch a manifest names, or None when it names none that can be one (hand-edited, foreign)."""
    try:
        return bytes.fromhex(str(manifest.get("epoch", "")))
    except ValueError:
        return None


def load_manifest(root: Path, dir_fd: int | None = None) -> tuple[dict | None, str | None]:
    """(the manifest of `root`, None), or (None, why it is missing or unreadable). Only a regular
    file is read, and at most `MANIFEST_MAX_BYTES` of it (a symlink to /dev/zero is refused).
    With `dir_fd` (a descriptor of `root`), the file is opened in that directory."""
    try:
        data = json.loads(read_regular_file(root / MANIFEST, MANIFEST_MAX_BYTES, dir_fd))
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


def write_manifest(root: Path, manifest: dict) -> None:
    """Replace the manifest of `root` atomically and durably; `ValueError` (nothing written) for
    a manifest larger than `load_manifest` reads back (identities within
    `kvtier.core.limits.MAX_IDENTITY_BYTES` never make one)."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if len(data) > MANIFEST_MAX_BYTES:
        raise ValueError(f"{root / MANIFEST}: a manifest of {len(data)} bytes would not be read back (at most "
                         f"{MANIFEST_MAX_BYTES}); its fingerprint ({len(str(manifest.get('fingerprint')))} "
                         f"characters) or layout ({len(str(manifest.get('layout')))}) is too long")
    write_file_atomic(root / MANIFEST, data)


def manifest_differences(found: dict | None, wanted: dict) -> list[str]:
    """Human-readable differences in geometry/fingerprint (empty when the contents are ours)."""
    if found is None:
        return ["no readable manifest"]
    if found.get("format_version") != wanted["format_version"]:  # the rest means nothing in another format
        return [version_difference(found.get("format_version"))]
    return [f"{k}: found {found.get(k)!r}, configured {wanted[k]!r}" for k in GEOMETRY if found.get(k) != wanted[k]]


def identity_differences(found: dict | None, wanted: dict) -> list[str]:
    """The `IDENTITY` fields in which a readable manifest of this format differs from `wanted`
    (empty when none does, or when there is no such manifest: nothing to keep)."""
    if found is None or found.get("format_version") != wanted["format_version"]:
        return []
    return [f"{k}: found {found.get(k)!r}, configured {wanted[k]!r}" for k in IDENTITY if found.get(k) != wanted[k]]


def version_difference(found_version) -> str:
    """Why a manifest of format `found_version` is not read by this version."""
    older = isinstance(found_version, int) and not isinstance(found_version, bool) and found_version < FORMAT_VERSION
    who = "an older kvtier" if older else "another kvtier version"
    return (f"slot format version {found_version!r}, written by {who}; this kvtier reads and writes version "
            f"{FORMAT_VERSION} only (payloads 4 KiB-aligned after a {HEADER_BYTES}-byte header page) and does "
            f"not migrate cached blocks")
