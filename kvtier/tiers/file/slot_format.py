"""The slot format of the file tier's slab (format version 2): one fixed-size slot per block.

A slot is one 4 KiB header page, then the payload, padded to a multiple of 4 KiB
(`slot_bytes_for`): every payload starts on a 4 KiB boundary of the file, so it can move by
O_DIRECT or GPUDirect Storage DMA straight between the file and a caller's (or a GPU's) buffer,
and a whole slot is still one contiguous I/O when header and payload travel together.

The header holds: magic `KVTB`, format version, key length, which payload checksum the slot
carries (`CHECK_CRC32`: zlib's CRC-32, computed on the host; `CHECK_TORCH`: `checksum.py`'s
torch checksum, computed on the device that holds the bytes), payload length, the payload
checksum, the 8-byte digest of the manifest the slot was written under (epoch included) and a
CRC-32 of the header itself; the key follows. A block is served only when all of them verify
(`verify_slot` / `verify_parts`). Version 1 (512-byte header, payload at offset 512) is never
read as version 2: its manifest names format_version 1 (the tier starts empty, with a warning that
says so), and a slot header of another version fails verification.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tiers.file.fileio import ALIGN

FORMAT_VERSION = 2  # of the slot header, the journal and the manifest
HEADER_BYTES = ALIGN  # the header's own page: payloads start 4 KiB-aligned

CHECK_CRC32 = 1  # payload checksum: zlib CRC-32 (host)
CHECK_TORCH = 2  # payload checksum: checksum.tensor_checksum (any torch device)
CHECK_NAMES = {CHECK_CRC32: "crc32", CHECK_TORCH: "torch-sum"}

SLOT_MAGIC = b"KVTB"
# magic, version, key_len, check kind, parts (0 before part checksums: "reserved"), payload_len, payload
# check, manifest digest, header_crc; the key follows.
_HDR = struct.Struct("<4sHHHHQI8sI")
MAX_KEY_BYTES = 480  # unchanged from version 1: the journal's size bound depends on it
PART_TABLE_AT = 1024  # the part table's offset in the header page: past the longest header and key (516 B)
MAX_PARTS = 256  # part checksums a slot may carry (the table and its CRC take 4 B each)


def _payload_crc32():
    """The fastest available implementation of zlib's CRC-32 (identical values, so the on-disk
    format does not depend on it): zlib-ng or ISA-L when installed, else zlib. Payload checksums
    are the only CPU work per byte on the hop (figures: docs/gds.md)."""
    import importlib

    for module in ("zlib_ng.zlib_ng", "isal.isal_zlib"):
        try:
            return importlib.import_module(module).crc32
        except Exception:  # noqa: BLE001 - optional accelerators
            continue
    return zlib.crc32


payload_crc32 = _payload_crc32()


def slot_bytes_for(block_bytes: int) -> int:
    """Size of one slot: the header page + the payload rounded up to 4 KiB."""
    return HEADER_BYTES + -(-block_bytes // ALIGN) * ALIGN


def pack_header(view: memoryview, key: bytes, payload_len: int, payload_check: int, digest: bytes,
                check_kind: int = CHECK_CRC32, parts: Sequence[int] = ()) -> None:
    """Write a slot header into `view` (a whole header page; without `parts`, at least
    `_HDR.size` + len(key) bytes), with the part table `parts` (`part_crcs`; CRC-32 slots only)."""
    if parts and (check_kind != CHECK_CRC32 or len(parts) > MAX_PARTS or parts[-1] != payload_check):
        raise ValueError(f"a part table of {len(parts)} running CRC-32s ending with the payload's is written "
                         f"into CRC-32 slots only, at most {MAX_PARTS} parts")
    fields = (SLOT_MAGIC, FORMAT_VERSION, len(key), check_kind, len(parts), payload_len, payload_check, digest)
    hcrc = zlib.crc32(key, zlib.crc32(_HDR.pack(*fields, 0)))
    _HDR.pack_into(view, 0, *fields, hcrc)
    end = _HDR.size + len(key)
    view[_HDR.size:end] = key
    view[end:] = bytes(len(view) - end)  # no stale bytes of a reused buffer in the header page
    if parts:
        table = struct.pack(f"<{len(parts)}I", *parts)
        view[PART_TABLE_AT:PART_TABLE_AT + len(table) + 4] = table + struct.pack("<I", zlib.crc32(table, hcrc))


def part_crcs(payload, parts: int) -> list[int]:
    """The part table of `payload` cut into `parts` equal parts (module docstring): running CRC-32s,
    the last one the payload's CRC-32. One pass over the payload, as its CRC-32 alone."""
    view = memoryview(payload).cast("B")
    size, crcs, crc = len(view) // parts, [], 0
    if size * parts != len(view):
        raise ValueError(f"a payload of {len(view)} bytes is not {parts} equal parts")
    for i in range(parts):
        crc = payload_crc32(view[i * size:(i + 1) * size], crc)
        crcs.append(crc)
    return crcs


@dataclass
class SlotHeader:
    key: bytes
    payload_len: int
    payload_crc: int  # the payload checksum, of the kind `check_kind` (named crc for version 1's sake)
    digest: bytes
    check_kind: int = CHECK_CRC32
    parts: tuple[int, ...] = ()  # the part table (running CRC-32s), empty when the slot has none


def parse_header(view) -> SlotHeader | str:
    """The header at the start of `view`, or a string saying why it is not a valid header."""
    if len(view) < _HDR.size:
        return "header truncated"
    magic, version, key_len, kind, parts, payload_len, check, digest, hcrc = _HDR.unpack_from(view, 0)
    if magic != SLOT_MAGIC:
        return "no slot header (bad magic)"
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}"
    if key_len > MAX_KEY_BYTES or key_len > len(view) - _HDR.size:
        return f"key length {key_len} out of range"
    key = bytes(view[_HDR.size:_HDR.size + key_len])
    if zlib.crc32(key, zlib.crc32(_HDR.pack(magic, version, key_len, kind, parts, payload_len, check,
                                             digest, 0))) != hcrc:
        return "header checksum mismatch"
    if kind not in CHECK_NAMES:
        return f"unknown payload checksum kind {kind}"
    table = _part_table(view, parts, kind, check, hcrc)
    if isinstance(table, str):
        return table
    return SlotHeader(key, payload_len, check, digest, kind, table)


def _part_table(view, parts: int, kind: int, check: int, hcrc: int) -> tuple[int, ...] | str:
    """The part table of a header whose fields verified, or why it cannot be one."""
    if not parts:
        return ()
    end = PART_TABLE_AT + 4 * parts
    if kind != CHECK_CRC32 or parts > MAX_PARTS or end + 4 > len(view):
        return f"a part table of {parts} entries in a {CHECK_NAMES[kind]} slot header of {len(view)} bytes"
    table = bytes(view[PART_TABLE_AT:end])
    if zlib.crc32(table, hcrc) != struct.unpack_from("<I", view, end)[0]:
        return "part table checksum mismatch"
    entries = struct.unpack(f"<{parts}I", table)
    if entries[-1] != check:
        return "part table does not end with the payload checksum"
    return entries


def payload_check(kind: int, payload) -> int:
    """The payload checksum of `kind` of a host buffer."""
    if kind == CHECK_TORCH:
        from kvtier.tiers.file.checksum import bytes_checksum

        return bytes_checksum(payload)
    return payload_crc32(payload)


def check_header(header_view, key: bytes | None, block_bytes: int, digest: bytes) -> SlotHeader | str:
    """The slot header in `header_view` if it may describe the block `key` (any key when None)
    of this manifest, else why not. The payload is not checked: see `verify_parts`."""
    header = parse_header(header_view)
    if isinstance(header, str):
        return header
    if header.digest != digest:
        return "written under another manifest (fingerprint, geometry or epoch differs)"
    if key is not None and header.key != key:
        return "holds another key"
    if header.payload_len != block_bytes:
        return f"payload length {header.payload_len}, expected {block_bytes}"
    return header


def verify_slot(view: memoryview, key: bytes | None, block_bytes: int, digest: bytes) -> str | None:
    """Check one slot image (`view` = header page + payload); None if it may be served, else why
    not. `key=None` accepts any key (inspection)."""
    return verify_parts(view, view[HEADER_BYTES:HEADER_BYTES + block_bytes], key, block_bytes, digest)


def verify_parts(header_view, payload, key: bytes | None, block_bytes: int, digest: bytes) -> str | None:
    """`verify_slot` with the header and the payload in separate (host) buffers."""
    header = check_header(header_view, key, block_bytes, digest)
    if isinstance(header, str):
        return header
    if payload_check(header.check_kind, payload) != header.payload_crc:
        return "payload checksum mismatch"
    return None


def verify_part(header: SlotHeader, part, index: int) -> str | None:
    """Check part `index` of a slot (`part`: exactly its bytes) against the header's part table
    (module docstring); None if it may be served, else why not. The header must carry a table
    of its reader's part count (the caller reads the whole payload otherwise: `verify_parts`)."""
    table = header.parts
    if not 0 <= index < len(table):
        return f"no part checksum {index} (the slot carries {len(table)})"
    if payload_crc32(part, table[index - 1] if index else 0) != table[index]:
        return f"part {index} checksum mismatch"
    return None
