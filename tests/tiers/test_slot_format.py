"""Slot format version 2: aligned payloads, checksum kinds, and version-1 roots never misread.

`fixtures/v1_root.tar.gz` is a root_dir written by kvtier's version-1 code (commit 482de30):
two 4096-byte blocks `key-0` (0x11 bytes) and `key-1` (0x22 bytes) under fingerprint
`v1-fixture`. Its slot_bytes (8192) equals version 2's for that block size, so only the format
version tells the two apart.
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from pathlib import Path

import pytest

from kvtier import IntegrityError
from kvtier.tiers.file import FileBackend
from kvtier.tiers.file.inspection import inspect_root
from kvtier.tiers.file.manifest import manifest_digest
from kvtier.tiers.file.slot_format import (
    CHECK_CRC32,
    CHECK_TORCH,
    FORMAT_VERSION,
    HEADER_BYTES,
    check_header,
    pack_header,
    parse_header,
    payload_crc32,
    slot_bytes_for,
    verify_slot,
)

FIXTURE = Path(__file__).parent / "fixtures" / "v1_root.tar.gz"


def v1_root(tmp_path) -> Path:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    root = tmp_path / "root"
    root.chmod(0o700)
    for name in os.listdir(root):
        (root / name).chmod(0o600)
    return root


@pytest.mark.parametrize("block_bytes", [1, 4096, 5000, 256 << 10, 8 << 20])
def test_payloads_start_on_4k_boundaries(block_bytes):
    slot = slot_bytes_for(block_bytes)
    assert HEADER_BYTES == 4096 and slot % 4096 == 0
    assert slot - HEADER_BYTES >= block_bytes and slot - HEADER_BYTES - block_bytes < 4096
    if block_bytes % 4096 == 0:  # the same slot size as version 1 (512-byte header, padded to 4 KiB)
        assert slot == block_bytes + 4096


def test_slab_payload_is_at_the_aligned_offset(tmp_path):
    b = FileBackend("nvme", 4, 8192, root_dir=str(tmp_path / "r"), fingerprint="m", io="posix")
    try:
        data = bytes(range(256)) * 32
        b.write_blocks([2], [b"k2"], [data])
        with open(b.slab_path, "rb") as f:
            f.seek(2 * b.slot_bytes)
            image = f.read(b.slot_bytes)
        assert image[HEADER_BYTES:HEADER_BYTES + 8192] == data
        header = parse_header(image)
        assert header.key == b"k2" and header.check_kind == CHECK_CRC32
        assert header.payload_crc == payload_crc32(data)
        assert b.manifest["format_version"] == FORMAT_VERSION == 2 and b.manifest["header_bytes"] == 4096
    finally:
        b.close()


def test_torch_checksum_kind_verifies_on_the_host():
    from kvtier.tiers.file.checksum import bytes_checksum

    image = bytearray(slot_bytes_for(4096))
    image[HEADER_BYTES:] = os.urandom(4096)
    payload = bytes(image[HEADER_BYTES:])
    pack_header(memoryview(image)[:HEADER_BYTES], b"k", 4096, bytes_checksum(payload), b"d" * 8, CHECK_TORCH)
    assert verify_slot(memoryview(image), b"k", 4096, b"d" * 8) is None
    image[HEADER_BYTES + 4000] ^= 4
    assert verify_slot(memoryview(image), b"k", 4096, b"d" * 8) == "payload checksum mismatch"


def test_unknown_checksum_kind_is_refused():
    image = bytearray(HEADER_BYTES)
    pack_header(memoryview(image), b"k", 4096, 0, b"d" * 8, check_kind=9)
    assert check_header(image, b"k", 4096, b"d" * 8) == "unknown payload checksum kind 9"


def test_v1_root_starts_empty_with_a_clear_warning(tmp_path, caplog):
    root = v1_root(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        b = FileBackend("nvme", 2, 4096, root_dir=str(root), fingerprint="v1-fixture", io="posix")
    try:
        warnings = [r.getMessage() for r in caplog.records if "not ours" in r.getMessage()]
        assert len(warnings) == 1
        assert "slot format version 1, written by an older kvtier" in warnings[0]
        assert "reads and writes version 2 only" in warnings[0]
        assert b.recover() == [] and b.committed() == {}
        with pytest.raises(IntegrityError):  # the v1 bytes are not there to serve, whatever the key
            b.read_blocks([0], [b"key-0"], [bytearray(4096)])
        b.write_blocks([0], [b"key-0"], [b"\x33" * 4096])
        out = bytearray(4096)
        b.read_blocks([0], [b"key-0"], [out])
        assert out == b"\x33" * 4096
    finally:
        b.close()
    assert json.loads((root / "manifest.json").read_text())["format_version"] == 2


def test_v1_slot_is_never_read_as_v2(tmp_path):
    """Even under a manifest edited to claim version 2, a version-1 slot fails verification."""
    root = v1_root(tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.update(format_version=2, header_bytes=HEADER_BYTES)
    slab = (root / "slab.0").read_bytes()
    for slot in (0, 1):
        image = memoryview(slab)[slot * 8192:(slot + 1) * 8192]
        assert verify_slot(image, None, 4096, manifest_digest(manifest)) == "format version 1, expected 2"


def test_inspect_names_the_old_version(tmp_path):
    root = v1_root(tmp_path)
    report = inspect_root(str(root), verify=True)
    assert "slot format version 1, written by an older kvtier" in report["index_health"]
    assert report["blocks"] == 0 and report["verified_ok"] == 0
