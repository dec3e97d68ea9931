"""A stored value: the payload first, then a 44-byte trailer.

    value = payload (P bytes) || trailer
    trailer = identity digest (16) | key digest (8) | payload length (u64) | payload CRC-32 (u32)
              | format version (u16) | checksum kind (u16) | magic b"KVRV"          (little-endian)

The payload sits at offset 0, so a GET reply's payload is received straight into the destination
buffer and verified there (`verify_parts`), and a SET sends the caller's buffer as it is followed by
the small trailer (no copy of the block). A value is
served only when its length is exactly P + 44, the magic, version and checksum kind are ours, the
identity digest (fingerprint + layout, keys.identity_digest) and the key digest (keys.key_digest of
the key it was read from) match, the length field is P and the CRC-32 of the payload matches.

The checksum is zlib's CRC-32 computed by zlib-ng (a dependency; the standard library's zlib is the
fallback and gives the same values). A block part of exactly 2^n bytes plus the trailer costs 1.25x
its size in server memory (the allocator's size classes): size `maxmemory` with that factor
(measured figures for both: docs/shared-tier.md).
"""

from __future__ import annotations

import struct
import zlib

from kvtier.tiers.remote.errors import ValueRejected
from kvtier.tiers.remote.keys import IDENTITY_DIGEST_BYTES, KEY_DIGEST_BYTES

try:  # the same CRC-32 values, ~13x faster
    from zlib_ng.zlib_ng import crc32 as payload_crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency
    payload_crc32 = zlib.crc32

MAGIC = b"KVRV"
FORMAT_VERSION = 1
CHECK_CRC32 = 1
TRAILER = struct.Struct(f"<{IDENTITY_DIGEST_BYTES}s{KEY_DIGEST_BYTES}sQIHH4s")  # the trailer above, packed
TRAILER_BYTES = TRAILER.size  # 44


def make_trailer(payload: memoryview, identity: bytes, key_digest: bytes) -> bytes:
    """The trailer that follows `payload` in its value."""
    return TRAILER.pack(identity, key_digest, payload.nbytes, payload_crc32(payload), FORMAT_VERSION,
                         CHECK_CRC32, MAGIC)


def encode_value(payload: memoryview, identity: bytes, key_digest: bytes) -> bytes:
    """The whole value as one bytes object (tests and tools; the store sends payload and trailer
    without joining them)."""
    return bytes(payload) + make_trailer(payload, identity, key_digest)


def verify_value(value: bytes, payload_bytes: int, identity: bytes, key_digest: bytes) -> memoryview:
    """The payload of `value` (a view, offset 0) when every check of the module docstring passes;
    else `ValueRejected` saying which check failed."""
    if not isinstance(value, (bytes, bytearray)):
        raise ValueRejected(f"value is a {type(value).__name__}, not a string value")
    payload = memoryview(value)[:payload_bytes]
    verify_parts(payload, len(value), bytes(value[payload_bytes:]), identity, key_digest)
    return payload


def verify_parts(payload: memoryview, length: int, trailer: bytes, identity: bytes, key_digest: bytes) -> None:
    """The checks of `verify_value` on a value received in parts: `payload` (its first
    `payload.nbytes` bytes, e.g. already in the destination buffer), the value's `length` and its
    `trailer` (the bytes after the payload). Raises `ValueRejected` saying which check failed."""
    payload_bytes = payload.nbytes
    if length != payload_bytes + TRAILER_BYTES or len(trailer) != TRAILER_BYTES:
        raise ValueRejected(f"value has {length} bytes, expected {payload_bytes + TRAILER_BYTES} "
                            f"(payload {payload_bytes} + trailer {TRAILER_BYTES}): truncated or foreign")
    ident, kdig, size, crc, version, kind, magic = TRAILER.unpack(trailer)
    if magic != MAGIC:
        raise ValueRejected(f"trailer magic {magic!r}, expected {MAGIC!r}: not a kvtier value")
    if version != FORMAT_VERSION or kind != CHECK_CRC32:
        raise ValueRejected(f"value format version {version} / checksum kind {kind}, "
                            f"this reader knows {FORMAT_VERSION} / {CHECK_CRC32}")
    if ident != identity:
        raise ValueRejected("identity digest differs: written by another model fingerprint or layout")
    if kdig != key_digest:
        raise ValueRejected("key digest differs: a value written under another key (or tenant, or rank)")
    if size != payload_bytes:
        raise ValueRejected(f"trailer says {size} payload bytes, expected {payload_bytes}")
    if payload_crc32(payload) != crc:
        raise ValueRejected("payload checksum mismatch: the value is corrupt")
