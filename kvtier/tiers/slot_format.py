"""The slot format of the file tier's slab: one fixed-size slot per block.

A slot is `HEADER_BYTES` of header then the payload, padded to a multiple of 4 KiB
(`slot_bytes_for`). The header holds: magic `KVTB`, format version, key length, payload length,
CRC-32 of the payload, the 8-byte digest of the manifest the slot was written under (epoch
included) and a CRC-32 of the header itself; the key follows. A block is served only when all of
them verify (`verify_slot` / `verify_parts`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from kvtier.tiers.fileio import ALIGN

FORMAT_VERSION = 1  # of the slot header, the journal and the manifest
HEADER_BYTES = 512

_SLOT_MAGIC = b"KVTB"
# magic, version, key_len, payload_len, payload_crc, manifest digest, header_crc; the key follows.
_HDR = struct.Struct("<4sHHQI8sI")
MAX_KEY_BYTES = HEADER_BYTES - _HDR.size


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
