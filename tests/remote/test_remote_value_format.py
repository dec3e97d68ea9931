"""The value trailer: a value verifies only for its own identity, key, length and bytes."""

from __future__ import annotations

import os

import pytest

from kvtier.tiers.remote.errors import ValueRejected
from kvtier.tiers.remote.keys import identity_digest, key_digest
from kvtier.tiers.remote.value_format import TRAILER, TRAILER_BYTES, encode_value, verify_value

IDENT = identity_digest("model", "layout")
KDIG = key_digest(b"kvt:t:0of1:ab:0")
PAYLOAD = os.urandom(4096)


def test_round_trip_payload_at_offset_zero():
    value = encode_value(memoryview(PAYLOAD), IDENT, KDIG)
    assert len(value) == len(PAYLOAD) + TRAILER_BYTES == len(PAYLOAD) + 44
    assert value[:len(PAYLOAD)] == PAYLOAD
    assert bytes(verify_value(value, len(PAYLOAD), IDENT, KDIG)) == PAYLOAD


def _flip(value: bytes, offset: int) -> bytes:
    b = bytearray(value)
    b[offset] ^= 0x10
    return bytes(b)


@pytest.mark.parametrize("case, words", [
    ("identity", "another model"), ("key", "another key"), ("truncated", "truncated"),
    ("payload bit", "checksum"), ("magic", "magic"), ("version", "version"), ("length field", "trailer says 4095"),
    ("longer", "truncated or foreign"),
])
def test_rejections(case, words):
    value = encode_value(memoryview(PAYLOAD), IDENT, KDIG)
    ident, kdig, n = IDENT, KDIG, len(PAYLOAD)
    if case == "identity":
        ident = identity_digest("model", "other-layout")
    elif case == "key":
        kdig = key_digest(b"kvt:t:0of1:ab:1")
    elif case == "truncated":
        value = value[:-1]
    elif case == "payload bit":
        value = _flip(value, 1234)
    elif case == "magic":
        value = _flip(value, len(value) - 1)
    elif case == "version":
        value = _flip(value, len(value) - 8)
    elif case == "length field":  # a trailer that claims another length (its other fields right)
        ident_, kdig_, _, crc, version, kind, magic = TRAILER.unpack_from(value, n)
        value = PAYLOAD + TRAILER.pack(ident_, kdig_, n - 1, crc, version, kind, magic)
    elif case == "longer":
        value = value + b"x"
    with pytest.raises(ValueRejected, match=words):
        verify_value(value, n, ident, kdig)
