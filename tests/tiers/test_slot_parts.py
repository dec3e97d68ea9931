"""Part checksums in the slot header (issue 38): a reader of one part of a block (one tensor-parallel
rank's bytes) verifies exactly the bytes it reads; slots without a part table, written by every
earlier writer, read and verify as before; an earlier reader accepts a slot that has one."""

from __future__ import annotations

import os
import struct
import zlib

import pytest

from kvtier.core.errors import ConfigError
from kvtier.tiers.file import FileBackend
from kvtier.tiers.file.slot_format import (
    CHECK_CRC32,
    CHECK_TORCH,
    HEADER_BYTES,
    PART_TABLE_AT,
    SLOT_MAGIC,
    pack_header,
    parse_header,
    part_crcs,
    payload_crc32,
    verify_part,
    verify_slot,
)

DIGEST = b"d" * 8
# The slot header as kvtier wrote and read it before part tables (commit 7a13f8a): magic, version,
# key length, check kind, reserved, payload length, payload check, manifest digest, header CRC.
_HDR = struct.Struct("<4sHHHHQI8sI")


def _slab_image(backend, slot: int) -> bytearray:
    with open(backend.slab_path, "rb") as f:
        f.seek(slot * backend.slot_bytes)
        return bytearray(f.read(backend.slot_bytes))


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_tier_of_two_parts_writes_a_part_table_each_part_verifies_alone(tmp_path, zero_copy):
    """Both write paths (zero-copy from an aligned buffer, and through the bounce buffer) write the
    table; a byte flipped in part 1 fails part 1 and the whole slot, never part 0."""
    import mmap

    b = FileBackend("nvme", 4, 8192, root_dir=str(tmp_path / "r"), fingerprint="m", io="posix", part_checks=2)
    try:
        data = os.urandom(8192)
        buf = mmap.mmap(-1, 8192) if zero_copy else bytearray(8192)
        buf[:] = data
        b.write_blocks([1], [b"k1"], [buf])
        image = _slab_image(b, 1)
        header = parse_header(image)
        assert header.parts == (payload_crc32(data[:4096]), payload_crc32(data)) == tuple(part_crcs(data, 2))
        assert header.payload_crc == payload_crc32(data)
        payload = memoryview(image)[HEADER_BYTES:HEADER_BYTES + 8192]
        assert [verify_part(header, payload[i * 4096:(i + 1) * 4096], i) for i in (0, 1)] == [None, None]
        image[HEADER_BYTES + 4096 + 100] ^= 1  # part 1 only
        assert verify_part(header, payload[:4096], 0) is None
        assert verify_part(header, payload[4096:], 1) == "part 1 checksum mismatch"
        assert verify_slot(memoryview(image), b"k1", 8192, b.digest) == "payload checksum mismatch"
        out = bytearray(8192)  # the tier's own (whole-slot) reads of a good slot are unchanged
        assert b.read_blocks([1], [b"k1"], [out]) == 8192 and out == data
    finally:
        b.close()


def test_a_slot_without_a_part_table_reads_as_before():
    """What every earlier writer wrote (the count field 0): no table, verified whole."""
    image = bytearray(HEADER_BYTES + 4096)
    image[HEADER_BYTES:] = os.urandom(4096)
    pack_header(memoryview(image)[:HEADER_BYTES], b"k", 4096, payload_crc32(image[HEADER_BYTES:]), DIGEST)
    header = parse_header(image)
    assert header.parts == () and verify_slot(memoryview(image), b"k", 4096, DIGEST) is None
    assert verify_part(header, image[HEADER_BYTES:HEADER_BYTES + 2048], 0) == "no part checksum 0 (the slot carries 0)"


def _earlier_reader(view) -> bytes | str:
    """kvtier's header check before part tables (commit 7a13f8a): the count was a reserved field,
    covered by the header CRC, and nothing past the key was read. Returns the key or why not."""
    magic, version, key_len, kind, reserved, length, check, digest, hcrc = _HDR.unpack_from(view, 0)
    key = bytes(view[_HDR.size:_HDR.size + key_len])
    fields = _HDR.pack(magic, version, key_len, kind, reserved, length, check, digest, 0)
    if magic != SLOT_MAGIC or zlib.crc32(key, zlib.crc32(fields)) != hcrc:
        return "refused"
    return key


def test_an_earlier_reader_accepts_a_slot_with_a_part_table():
    page = bytearray(HEADER_BYTES)
    data = os.urandom(3 * 4096)
    parts = part_crcs(data, 3)
    pack_header(memoryview(page), b"key", len(data), parts[-1], DIGEST, parts=parts)
    assert _earlier_reader(page) == b"key"
    assert parse_header(page).parts == tuple(parts)


@pytest.mark.parametrize("damage", ["table", "table_crc", "count"])
def test_a_damaged_part_table_fails_the_header(damage):
    page = bytearray(HEADER_BYTES)
    data = os.urandom(2 * 4096)
    parts = part_crcs(data, 2)
    pack_header(memoryview(page), b"key", len(data), parts[-1], DIGEST, parts=parts)
    if damage == "table":
        page[PART_TABLE_AT + 1] ^= 1
    elif damage == "table_crc":
        page[PART_TABLE_AT + 8] ^= 1
    else:  # a count that the header CRC does not cover any more
        struct.pack_into("<H", page, 10, 3)
    why = parse_header(page)
    assert why == ("header checksum mismatch" if damage == "count" else "part table checksum mismatch")


def test_a_table_that_does_not_end_with_the_payload_checksum_is_refused():
    page = bytearray(HEADER_BYTES)
    pack_header(memoryview(page), b"key", 8192, 7, DIGEST, parts=[5, 7])
    table = struct.pack("<2I", 5, 6)  # rewritten consistently, but ending elsewhere
    hcrc = struct.unpack_from("<I", page, _HDR.size - 4)[0]
    page[PART_TABLE_AT:PART_TABLE_AT + 12] = table + struct.pack("<I", zlib.crc32(table, hcrc))
    assert parse_header(page) == "part table does not end with the payload checksum"


def test_part_tables_are_written_into_crc32_slots_only():
    with pytest.raises(ValueError, match="CRC-32 slots only"):
        pack_header(memoryview(bytearray(HEADER_BYTES)), b"k", 8192, 7, DIGEST, CHECK_TORCH, parts=[5, 7])
    with pytest.raises(ValueError, match="CRC-32 slots only"):  # the last entry is the payload's
        pack_header(memoryview(bytearray(HEADER_BYTES)), b"k", 8192, 7, DIGEST, CHECK_CRC32, parts=[5, 6])
    with pytest.raises(ValueError, match="not 3 equal parts"):
        part_crcs(bytes(8192), 3)


def test_part_checks_must_divide_the_block(tmp_path):
    with pytest.raises(ConfigError, match="part_checks: 3 does not divide the blocks of 8192 bytes"):
        FileBackend("nvme", 4, 8192, root_dir=str(tmp_path / "r"), fingerprint="m", io="posix", part_checks=3)


def test_inspect_verify_checks_whole_slots_and_their_part_tables(tmp_path):
    """The tier's own whole-slot checks (`kvtier inspect --verify`, like promotion) are unchanged
    by part tables, and count a slot whose table was damaged as bad."""
    from kvtier.tiers.file.inspection import inspect_root

    b = FileBackend("nvme", 4, 8192, root_dir=str(tmp_path / "r"), fingerprint="m", io="posix", part_checks=2)
    try:
        b.write_blocks([0, 1], [b"a", b"b"], [os.urandom(8192), os.urandom(8192)])
        root, slot_bytes = b.root, b.slot_bytes
    finally:
        b.close()
    report = inspect_root(str(root), verify=True)
    assert (report["verified_ok"], report["verify_failed"]) == (2, 0)
    with open(root / "slab.0", "r+b") as f:  # one bit of slot 1's table
        f.seek(slot_bytes + PART_TABLE_AT + 2)
        byte = f.read(1)
        f.seek(slot_bytes + PART_TABLE_AT + 2)
        f.write(bytes([byte[0] ^ 1]))
    report = inspect_root(str(root), verify=True)
    assert (report["verified_ok"], report["verify_failed"]) == (1, 1)
    assert [f["reason"] for f in report["failures"]] == ["part table checksum mismatch"]
