"""`SlabReader` (issue 38): a process that does not own a file tier reads it, read-only.

It reads exactly its part of each slot and verifies exactly those bytes (a rank of a TP engine);
it cannot write, truncate, extend, chmod or unlink anything of the tier, never takes its lock,
never forgets a bad block itself (the owner does), and refuses what the tier's own opening
refuses (symlinks, hard links, other users' or group-writable files, another identity)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError, IntegrityError, KVTierError
from kvtier.tiers.file import FileBackend
from kvtier.tiers.file.manifest import wanted_manifest
from kvtier.tiers.file.reader import SlabReader
from kvtier.tiers.file.slot_format import HEADER_BYTES

SLOTS = 6


def _owner(tmp_path, block_bytes=8192, parts=2, fingerprint="m"):
    return FileBackend("disk", SLOTS, block_bytes, root_dir=str(tmp_path / "r"), fingerprint=fingerprint,
                       io="posix", part_checks=parts)


def _wanted(b: FileBackend, **changes) -> dict:
    args = {"block_bytes": b.block_bytes, "slot_bytes": b.slot_bytes, "num_slots": b.num_blocks,
            "fingerprint": "m", "layout": b.layout, **changes}
    return wanted_manifest(**args)


def _reader(b: FileBackend, part=(0, 1), **changes) -> SlabReader:
    return SlabReader("disk", str(b.root), _wanted(b, **changes), part)


def _data(n: int, block_bytes: int) -> list[bytes]:
    return [os.urandom(block_bytes) for _ in range(n)]


def _flip(b: FileBackend, slot: int, at: int) -> None:
    with open(b.slab_path, "r+b") as f:
        f.seek(slot * b.slot_bytes + HEADER_BYTES + at)
        byte = f.read(1)
        f.seek(slot * b.slot_bytes + HEADER_BYTES + at)
        f.write(bytes([byte[0] ^ 0x80]))


def _snapshot(root: Path) -> dict:
    """Every file of the tier: its bytes' digest, size, mode and mtime."""
    out = {}
    for path in sorted(root.iterdir()):
        st = path.stat()
        out[path.name] = (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, stat.S_IMODE(st.st_mode),
                          st.st_mtime_ns)
    return out


@pytest.mark.parametrize("block_bytes", [8192, 12288])  # parts of 4 KiB, and of 6 KiB (unaligned: bounced)
def test_each_part_reads_back_exactly_its_bytes(tmp_path, block_bytes):
    b = _owner(tmp_path, block_bytes)
    readers = []
    try:
        data = _data(3, block_bytes)
        b.write_blocks([0, 1, 4], [b"a", b"b", b"c"], data)
        half = block_bytes // 2
        readers = [_reader(b, (r, 2)) for r in range(2)] + [_reader(b)]
        assert readers[0].io.direct == b.io.direct  # O_DIRECT wherever the owner has it
        for r in range(2):
            out = [bytearray(half) for _ in data]
            assert readers[r].read_blocks([0, 1, 4], [b"a", b"b", b"c"], out) == 3 * half
            assert [bytes(o) for o in out] == [d[r * half:(r + 1) * half] for d in data]
        whole = [bytearray(block_bytes) for _ in data]
        readers[2].read_blocks([4, 0, 1], [b"c", b"a", b"b"], whole)
        assert [bytes(o) for o in whole] == [data[2], data[0], data[1]]
    finally:
        for reader in readers:
            reader.close()
        b.close()


def test_one_part_corrupted_fails_that_part_only_and_nothing_is_forgotten(tmp_path):
    b = _owner(tmp_path)
    r0, r1, whole = _reader(b, (0, 2)), _reader(b, (1, 2)), _reader(b)
    try:
        b.write_blocks([2, 3], [b"x", b"y"], _data(2, 8192))
        _flip(b, 3, 4096 + 17)  # part 1 of slot 3
        r0.read_blocks([2, 3], [b"x", b"y"], [bytearray(4096), bytearray(4096)])  # rank 0's bytes are fine
        with pytest.raises(IntegrityError, match="slot 3: part 1 checksum mismatch") as bad:
            r1.read_blocks([2, 3], [b"x", b"y"], [bytearray(4096), bytearray(4096)])
        assert bad.value.slots == (3,)
        with pytest.raises(IntegrityError, match="slot 3: payload checksum mismatch"):
            whole.read_blocks([3], [b"y"], [bytearray(8192)])
        assert sorted(b.committed()) == [2, 3]  # a reader forgets nothing: the owner drops bad blocks
    finally:
        for reader in (r0, r1, whole):
            reader.close()
        b.close()


def test_a_slot_without_a_part_table_is_read_whole_and_verified(tmp_path):
    """Slots written before part checksums (or by the GPU direct path) carry no table: a part
    reader reads the whole payload and checks its checksum, so a damaged other part fails it too
    (it cannot tell which part is damaged; it never serves bytes nobody verified)."""
    b = _owner(tmp_path, parts=1)
    r1 = _reader(b, (1, 2))
    try:
        data = _data(2, 8192)
        b.write_blocks([0, 1], [b"p", b"q"], data)
        out = [bytearray(4096), bytearray(4096)]
        r1.read_blocks([0, 1], [b"p", b"q"], out)
        assert [bytes(o) for o in out] == [d[4096:] for d in data]
        _flip(b, 0, 10)  # part 0 of a slot without a table
        with pytest.raises(IntegrityError, match="slot 0: payload checksum mismatch"):
            r1.read_blocks([0], [b"p"], [bytearray(4096)])
    finally:
        r1.close()
        b.close()


def test_a_reader_cannot_write_extend_or_lock_and_changes_nothing(tmp_path):
    b = _owner(tmp_path)
    reader = _reader(b, (1, 2))
    try:
        b.write_blocks([0], [b"k"], _data(1, 8192))
        b.sync()
        before = _snapshot(b.root)
        assert fcntl.fcntl(reader.io.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(OSError):
            os.pwrite(reader.io.fd, b"x", 0)  # the kernel refuses: a read-only descriptor
        with pytest.raises(PermissionError):
            reader.io.pwrite(0, b"x" * 4096)
        with pytest.raises(ValueError, match="slot 6 out of range 0..5"):  # never reads, nor extends, past the slab
            reader.read_blocks([SLOTS], [b"k"], [bytearray(4096)])
        with pytest.raises(IntegrityError):
            reader.read_blocks([1], [b"k"], [bytearray(4096)])  # a slot never written: fails verification
        reader.read_blocks([0], [b"k"], [bytearray(4096)])
        assert _snapshot(b.root) == before  # lock, manifest, journal, slab: bytes, sizes, modes, mtimes
        with open(b.root / "lock", "rb") as lock:  # the owner's flock is the only one: the reader takes none
            with pytest.raises(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holders = [p for p in Path(f"/proc/{os.getpid()}/fd").iterdir() if os.path.realpath(p) == str(b.root / "lock")]
        assert len(holders) == 1  # the owner's descriptor only: the reader opened no lock file
    finally:
        reader.close()
        b.close()


def test_a_truncated_slab_is_a_failed_block_and_stays_truncated(tmp_path):
    b = _owner(tmp_path)
    try:
        b.write_blocks([4], [b"t"], _data(1, 8192))
        reader = _reader(b, (1, 2))
        os.truncate(b.slab_path, 4 * b.slot_bytes + HEADER_BYTES)  # cuts slot 4's payload
        with pytest.raises(IntegrityError, match="slot 4: slab truncated"):
            reader.read_blocks([4], [b"t"], [bytearray(4096)])
        assert os.stat(b.slab_path).st_size == 4 * b.slot_bytes + HEADER_BYTES
        reader.close()
    finally:
        b.close()


def test_the_identity_a_load_names_must_be_the_tiers(tmp_path):
    b = _owner(tmp_path)
    reader = _reader(b)
    try:
        reader.check_identity(b.digest)
        reader.check_identity(None)
        with pytest.raises(KVTierError, match=f"a load names tier identity {'00' * 8}, the manifest in"):
            reader.check_identity(bytes(8))
    finally:
        reader.close()
        b.close()


@pytest.mark.parametrize("change", [{"fingerprint": "another model"}, {"layout": "other"}, {"num_slots": SLOTS + 1}])
def test_a_manifest_of_another_identity_or_geometry_is_refused(tmp_path, change):
    b = _owner(tmp_path)
    try:
        field = next(iter(change))
        with pytest.raises(KVTierError, match=f"does not hold the tier this process's configuration describes "
                                              f"\\({field}: found"):
            _reader(b, **change)
    finally:
        b.close()


@pytest.mark.parametrize("hostile", ["symlink", "hardlink", "group_writable", "root_group_writable", "missing"])
def test_what_the_tiers_opening_refuses_the_reader_refuses_changing_nothing(tmp_path, hostile):
    b = _owner(tmp_path)
    wanted = _wanted(b)
    root = b.root
    b.close()
    slab = root / "slab.0"
    if hostile == "symlink":
        os.rename(slab, tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", slab)
    elif hostile == "hardlink":
        os.link(slab, tmp_path / "second-name")
    elif hostile == "group_writable":
        os.chmod(slab, 0o660)
    elif hostile == "root_group_writable":
        os.chmod(root, 0o770)
    else:
        root = tmp_path / "nowhere"
    before = _snapshot(root) if root.exists() else None
    with pytest.raises(ConfigError, match="root_dir: "):
        SlabReader("disk", str(root), wanted, (0, 2))
    assert (_snapshot(root) if root.exists() else None) == before  # no chmod, no file created
    assert not (tmp_path / "nowhere").exists()
