"""FileBackend: byte API, restart recovery, integrity (never serve bad bytes), lock, options, inspect."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat

import pytest
from conftest import flip

from kvtier import ConfigError, IntegrityError, KVTierError, load_config_text
from kvtier.core.types import BlockStatus
from kvtier.tiers.file import backend as file_module
from kvtier.tiers.file import fileio
from kvtier.tiers.file.backend import HEADER_BYTES, JOURNAL, MANIFEST, SLAB, FileBackend
from kvtier.tiers.file.inspection import inspect_root

BLOCK = 16 * 1024


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() + (i % 3).to_bytes(4, "big")


def payload(i: int, size: int = BLOCK) -> bytes:
    return hashlib.shake_128(str(i).encode()).digest(size)


def open_backend(root, num_blocks=32, block_bytes=BLOCK, **options):
    options.setdefault("io", "posix")
    options.setdefault("fingerprint", "test-model")
    return FileBackend("disk", num_blocks, block_bytes, 16, root_dir=str(root), **options)


@pytest.fixture
def root(tmp_path):
    return tmp_path / "kv"


def write(b, slots, ids):
    return b.write_blocks(slots, [key(i) for i in ids], [payload(i) for i in ids])


def read(b, slots, ids) -> list[bytes]:
    out = [bytearray(b.block_bytes) for _ in slots]
    assert b.read_blocks(slots, [key(i) for i in ids], out) == len(slots) * b.block_bytes
    return [bytes(o) for o in out]


# ------------------------------------------------------------------ byte API
def test_round_trip_any_buffer_kind(root):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    b = open_backend(root)
    arena = bytearray(4 * BLOCK)
    arena[BLOCK:2 * BLOCK] = payload(1)
    as_numpy = np.frombuffer(payload(2), dtype=np.float16).copy()
    as_torch = torch.frombuffer(bytearray(payload(3)), dtype=torch.bfloat16)
    buffers = [payload(0), memoryview(arena)[BLOCK:2 * BLOCK], as_numpy, as_torch.view(torch.int16).numpy()]
    assert b.write_blocks([5, 6, 7, 20], [key(i) for i in range(4)], buffers) == 4 * BLOCK
    assert read(b, [20, 5, 7, 6], [3, 0, 2, 1]) == [payload(3), payload(0), payload(2), payload(1)]
    into = torch.empty(BLOCK // 2, dtype=torch.float16)
    b.read_blocks([6], [key(1)], [into.numpy()])
    assert into.numpy().tobytes() == payload(1)
    b.close()


def test_adjacent_slots_are_coalesced(root, monkeypatch):
    b = open_backend(root)
    calls = []
    real_pwrite, real_pwritev = type(b.io).pwrite, type(b.io).pwritev
    # Bounce buffer or zero copy (buffered I/O takes the iovecs as they are): count either.
    monkeypatch.setattr(type(b.io), "pwrite",
                        lambda self, off, buf: (calls.append((off, len(buf))), real_pwrite(self, off, buf)))
    monkeypatch.setattr(type(b.io), "pwritev",
                        lambda self, off, iovs: (calls.append((off, sum(len(v) for v in iovs))),
                                                 real_pwritev(self, off, iovs)))
    write(b, [9, 3, 4, 5, 6, 11], range(6))
    assert sorted(calls) == [(3 * b.slot_bytes, 4 * b.slot_bytes), (9 * b.slot_bytes, b.slot_bytes),
                             (11 * b.slot_bytes, b.slot_bytes)]
    assert b.slot_bytes % 4096 == 0 and b.slot_bytes >= HEADER_BYTES + BLOCK
    b.close()


def test_bad_arguments_are_rejected(root):
    b = open_backend(root)
    with pytest.raises(ValueError, match="lengths must match"):
        b.write_blocks([0, 1], [key(0)], [payload(0)])
    with pytest.raises(ValueError, match="buffer of"):
        b.write_blocks([0], [key(0)], [b"short"])
    with pytest.raises(ValueError, match="out of range"):
        b.write_blocks([32], [key(0)], [payload(0)])
    with pytest.raises(ValueError, match="writable"):
        b.read_blocks([0], [key(0)], [payload(0)])
    b.close()
    b.close()  # idempotent
    with pytest.raises(KVTierError, match="closed"):
        write(b, [0], [0])


# ------------------------------------------------------------------ restart
def test_restart_recovers_committed_blocks_and_claims_slots(root):
    b = open_backend(root)
    write(b, [0, 1, 2, 10], [0, 1, 2, 10])
    b.free(BlockStatus(1))  # evicted: must not come back
    write(b, [2], [22])  # slot reused for another key: the latest wins
    b.close()
    b = open_backend(root)
    found = b.recover()
    assert [(k, blk.block_id, blk.ref_cnt) for k, blk in found] == [(key(0), 0, 0), (key(22), 2, 0), (key(10), 10, 0)]
    assert b.recover() == []
    assert b.get_num_free_blocks() == 29
    fresh = {blk.block_id for blk in b.allocate_blocks([b"x"] * 29)}
    assert fresh.isdisjoint({0, 2, 10}) and len(fresh) == 29
    assert read(b, [0, 2, 10], [0, 22, 10]) == [payload(0), payload(22), payload(10)]
    b.close()


def test_same_key_in_two_slots_recovers_latest_copy(root):
    b = open_backend(root)
    write(b, [4], [7])
    write(b, [9], [7])  # re-stored elsewhere without the first slot being freed
    b.close()
    b = open_backend(root)
    assert [(k, blk.block_id) for k, blk in b.recover()] == [(key(7), 9)]
    b.close()
    b = open_backend(root)  # the stale slot was released in the journal too
    assert [blk.block_id for _, blk in b.recover()] == [9]
    b.close()


@pytest.mark.parametrize("limit", ["records", "bytes"])
def test_journal_is_compacted(root, monkeypatch, limit):
    if limit == "records":
        monkeypatch.setattr(FileBackend, "compact_min_records", 32)
    else:  # a journal file too small for the records between two compactions
        monkeypatch.setattr(file_module, "journal_capacity", lambda num_slots, compact_min_records: 1024)
    b = open_backend(root, num_blocks=4)
    for i in range(200):
        slot = i % 4
        b.free(BlockStatus(slot)) if i >= 4 else None
        write(b, [slot], [i])
    b.close()
    assert inspect_root(str(root))["journal_records"] < 40  # 200 PUTs + 196 DELs were appended
    b = open_backend(root, num_blocks=4)
    assert sorted((blk.block_id, k) for k, blk in b.recover()) == [(s, key(196 + s)) for s in range(4)]
    assert read(b, [0, 3], [196, 199]) == [payload(196), payload(199)]
    b.close()


def test_torn_journal_tail_is_ignored(root, caplog):
    b = open_backend(root)
    write(b, [0, 1], [0, 1])
    b.close()
    with open(root / JOURNAL, "ab") as f:
        f.write(b"\x17" * 13)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        b = open_backend(root)
    assert sorted(blk.block_id for _, blk in b.recover()) == [0, 1]
    assert any("torn journal tail" in r.message for r in caplog.records)
    write(b, [2], [2])  # appends after the good prefix
    b.close()
    b = open_backend(root)
    assert sorted(blk.block_id for _, blk in b.recover()) == [0, 1, 2]
    b.close()


@pytest.mark.parametrize("change", [{"block_bytes": 2 * BLOCK}, {"num_blocks": 64}, {"fingerprint": "other"}])
def test_manifest_mismatch_starts_empty(root, caplog, change):
    b = open_backend(root, fingerprint="model-a")
    write(b, [0, 1], [0, 1])
    b.close()
    options = {"fingerprint": "model-a", **change, "on_identity_change": "reset"}  # (else refused: test_identity)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        b = open_backend(root, **options)
    assert b.recover() == []
    assert len([r for r in caplog.records if "not ours" in r.message]) == 1
    b.close()


def test_foreign_manifest_and_foreign_slots_are_never_served(tmp_path):
    a, b = open_backend(tmp_path / "a"), open_backend(tmp_path / "b")
    write(a, [0], [5])
    b.write_blocks([0], [key(5)], [payload(6)])  # same key and slot, other bytes, other epoch
    a.close()
    # Bytes written under another manifest (epoch) are refused even if key and CRC are intact.
    with open(tmp_path / "a" / SLAB, "rb") as src, open(tmp_path / "b" / SLAB, "r+b") as dst:
        dst.write(src.read(b.slot_bytes))
    with pytest.raises(IntegrityError, match="another manifest"):
        read(b, [0], [5])
    b.close()
    # A manifest copied from another tier does not match this tier's journal: start empty.
    (tmp_path / "b" / MANIFEST).write_bytes((tmp_path / "a" / MANIFEST).read_bytes())
    b = open_backend(tmp_path / "b")
    assert b.recover() == []
    b.close()


# ------------------------------------------------------------------ integrity
@pytest.mark.parametrize("where", ["payload", "header-key", "header-length", "padding-is-harmless"])
def test_corruption_raises_integrity_error(root, where):
    b = open_backend(root)
    write(b, [3, 4, 5], [3, 4, 5])
    base = 4 * b.slot_bytes
    offset = {"payload": base + HEADER_BYTES + BLOCK - 1, "header-key": base + 40,
              "header-length": base + 12, "padding-is-harmless": base + HEADER_BYTES + BLOCK + 100}[where]
    if offset >= base + b.slot_bytes:
        offset = base + HEADER_BYTES - 1  # no padding at this block size: header slack instead
    flip(b.slab_path, offset)
    out = [bytearray(BLOCK) for _ in range(3)]
    if where == "padding-is-harmless":
        b.read_blocks([3, 4, 5], [key(3), key(4), key(5)], out)
        assert bytes(out[1]) == payload(4)
        b.close()
        return
    with pytest.raises(IntegrityError, match="slot 4"):
        b.read_blocks([3, 4, 5], [key(3), key(4), key(5)], out)
    assert bytes(out[0]) == payload(3) and bytes(out[2]) == payload(5)
    assert bytes(out[1]) != payload(4) or where != "payload"
    assert 4 not in b.committed()
    b.close()
    b = open_backend(root)
    assert sorted(blk.block_id for _, blk in b.recover()) == [3, 5]
    b.close()


def test_wrong_key_is_never_served(root):
    b = open_backend(root)
    write(b, [0], [0])
    with pytest.raises(IntegrityError, match="another key"):
        b.read_blocks([0], [key(1)], [bytearray(BLOCK)])
    b.close()


def test_truncated_slab(root):
    b = open_backend(root)
    write(b, [0, 1, 30, 31], [0, 1, 30, 31])
    os.truncate(b.slab_path, 2 * b.slot_bytes + 100)
    with pytest.raises(IntegrityError, match="truncated|bad magic"):
        read(b, [30, 31], [30, 31])
    assert read(b, [0, 1], [0, 1]) == [payload(0), payload(1)]
    b.close()
    os.truncate(root / SLAB, b.slot_bytes)
    b = open_backend(root)  # restart: blocks past the end are dropped, the slab is re-extended
    assert [blk.block_id for _, blk in b.recover()] == [0]
    assert os.stat(root / SLAB).st_size == 32 * b.slot_bytes
    assert read(b, [0], [0]) == [payload(0)]
    b.close()


# ------------------------------------------------------------------ lock, files, options
def test_second_owner_is_refused_with_pid(root):
    b = open_backend(root)
    with pytest.raises(KVTierError, match=rf"{root}.*pid {os.getpid()}"):
        open_backend(root)
    b.close()
    open_backend(root).close()  # released on close


def test_directory_and_file_modes(root):
    open_backend(root).close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for name in os.listdir(root):
        assert stat.S_IMODE((root / name).stat().st_mode) & 0o077 == 0, name


def _open_fds_under(directory) -> list[str]:
    """Paths under `directory` that this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory) + "/"):
            found.append(target)
    return found


@pytest.mark.parametrize("step", ["io", "commit_log"])
def test_build_failing_after_the_root_is_opened_leaves_nothing_behind(tmp_path, monkeypatch, step):
    """A step that fails once root_dir is locked and its files exist (the `BlockIO`, the commit
    log) removes what the build created, closes every file and releases the lock."""
    root = tmp_path / "new" / "kv"

    def failing(*args, **kw):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(file_module, "choose_io" if step == "io" else "CommitLog", failing)
    with pytest.raises(ConfigError, match=rf"root_dir: file tier 'disk' cannot use {root}: .*Input/output error"):
        open_backend(root)
    assert not (tmp_path / "new").exists()
    assert _open_fds_under(tmp_path) == []
    monkeypatch.undo()
    b = open_backend(root)  # the lock was released
    write(b, [0], [0])
    b.close()
    assert _open_fds_under(tmp_path) == []


def test_yaml_options_are_validated():
    base = """
block_bytes: 64KiB
tiers:
  - {name: mem, backend: memory, capacity: 4 blocks}
  - {name: disk, backend: file, capacity: 8 blocks%s}
"""
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.root_dir: missing"):
        load_config_text(base % "")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.io: 'gds' is not an I/O kind"):
        load_config_text(base % ", root_dir: /tmp/x, io: gds")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.num_threads"):
        load_config_text(base % ", root_dir: /tmp/x, num_threads: 0")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.fingerprint"):
        load_config_text(base % ", root_dir: /tmp/x, fingerprint: 3")
    for bad in ("-1", "fast", "true", "7200"):
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.sync_interval: expected seconds between background"):
            load_config_text(base % f", root_dir: /tmp/x, sync_interval: {bad}")
    assert load_config_text(base % ", root_dir: /tmp/x, sync_interval: 0").tiers[1].options["sync_interval"] == 0
    cfg = load_config_text(base % ", root_dir: /tmp/x")
    assert dict(cfg.tiers[1].options) == {"root_dir": "/tmp/x", "io": "auto", "fingerprint": "", "num_threads": 4,
                                          "sync_interval": 1.0, "on_identity_change": "refuse", "part_checks": 1}
    for bad in ("0", "true", "257", "2.0"):
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.part_checks: expected the number of equal parts"):
            load_config_text(base % f", root_dir: /tmp/x, part_checks: {bad}")


def test_odirect_refused_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    """Each I/O choice warns once, naming the tier and why; the probe itself keeps no state."""
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 8192)
    real_open = os.open

    def no_direct(p, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(fileio.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        assert fileio.probe_direct(str(path)) is False
        assert fileio.probe_direct(str(path)) is False
        assert not caplog.records
        opened = [fileio.choose_io("posix", str(path), 2, tier=name) for name in ("disk", "disk2")]
    warnings = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert warnings == [f"file tier {name}: O_DIRECT refused (EINVAL) on the filesystem of {path}; using buffered "
                        f"I/O (page cache)" for name in ("disk", "disk2")]
    for block_io in opened:
        assert block_io.name == "posix" and block_io.direct is False
        block_io.close()


# ------------------------------------------------------------------ kvikio I/O on host memory
def test_kvikio_io_round_trip_and_restart(root):
    if not fileio.kvikio_importable():
        pytest.skip("kvikio not installed (CI installs it: see tests/tiers/test_file_backend.py docstring)")
    from tests.support.fake_cuda import load_fake_libcuda

    load_fake_libcuda()
    b = open_backend(root, io="kvikio", num_threads=2)
    assert b.io.name == "kvikio"
    write(b, [0, 1, 2, 8], [0, 1, 2, 8])
    assert read(b, [8, 0, 1, 2], [8, 0, 1, 2]) == [payload(8), payload(0), payload(1), payload(2)]
    flip(b.slab_path, b.slot_bytes + HEADER_BYTES + 5)
    with pytest.raises(IntegrityError):
        read(b, [1], [1])
    b.close()
    b = open_backend(root, io="kvikio")
    assert sorted(blk.block_id for _, blk in b.recover()) == [0, 2, 8]
    assert read(b, [2], [2]) == [payload(2)]
    b.close()


def test_kvikio_io_leaves_kvikio_settings_as_it_found_them(root):
    """Compat mode is set only while a `KvikioIO` opens its file (I/O after that still runs in compat
    mode: without nvidia-fs, cuFile would hang here), and the process-wide thread pool is back to
    its size once the last `KvikioIO` is closed."""
    if not fileio.kvikio_importable():
        pytest.skip("kvikio not installed (CI installs it: see tests/tiers/test_file_backend.py docstring)")
    import kvikio
    import kvikio.defaults

    from tests.support.fake_cuda import load_fake_libcuda

    load_fake_libcuda()
    before = {name: kvikio.defaults.get(name) for name in ("compat_mode", "num_threads")}
    first = open_backend(root, io="kvikio", num_threads=before["num_threads"] + 3)
    assert kvikio.defaults.get("compat_mode") == before["compat_mode"]
    assert kvikio.defaults.get("num_threads") == before["num_threads"] + 3
    second = open_backend(root.parent / "kv2", io="kvikio", num_threads=1)
    write(first, [0, 1], [0, 1])
    write(second, [3], [3])
    assert read(first, [1, 0], [1, 0]) == [payload(1), payload(0)]
    first.close()
    assert kvikio.defaults.get("num_threads") == before["num_threads"] + 3  # `second` still uses the pool
    assert read(second, [3], [3]) == [payload(3)]
    second.close()
    assert {name: kvikio.defaults.get(name) for name in before} == before


# ------------------------------------------------------------------ inspect
def test_inspect_is_read_only_and_counts_bad_blocks(root):
    b = open_backend(root, fingerprint="m1")
    write(b, [0, 1, 2, 3], [0, 1, 2, 3])
    flip(b.slab_path, 2 * b.slot_bytes + HEADER_BYTES + 7)

    def snapshot():
        return {n: (root / n).read_bytes() for n in sorted(os.listdir(root))}

    before = snapshot()
    report = inspect_root(str(root), verify=True)  # while `b` holds the lock
    assert snapshot() == before
    assert report["blocks"] == 4 and report["bytes"] == 4 * BLOCK
    assert report["fingerprint"] == "m1" and report["num_slots"] == 32
    assert report["index_health"] == "ok"
    assert report["verified_ok"] == 3 and report["verify_failed"] == 1
    assert report["failures"] == [{"key": key(2).hex(), "slot": 2, "reason": "payload checksum mismatch"}]
    assert report["lock_holder"] == {"pid": os.getpid(), "alive": True}
    assert "verified_ok" not in inspect_root(str(root))
    b.close()
    with open(root / JOURNAL, "ab") as f:
        f.write(b"junk")
    assert "torn journal tail" in inspect_root(str(root))["index_health"]
    assert inspect_root(str(root / "nothing"))["index_health"].startswith("no readable manifest")


def test_failed_commit_fails_every_caller_and_commits_nothing(root, monkeypatch):
    b = open_backend(root, sync_interval=0)
    write(b, [0], [0])
    real_sync = type(b.io).sync
    def eio(self):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(type(b.io), "sync", eio)
    with pytest.raises(OSError, match="Input/output error"):
        write(b, [1, 2], [1, 2])
    assert set(b.committed()) == {0}
    monkeypatch.setattr(type(b.io), "sync", real_sync)
    write(b, [3], [3])
    b.close()
    b = open_backend(root)
    assert sorted(blk.block_id for _, blk in b.recover()) == [0, 3]
    b.close()


def test_concurrent_writers_share_commits(root, monkeypatch):
    """32 stores from 8 threads on a slow disk (each fdatasync takes 50 ms): stores that finish
    while a commit is syncing are covered by the next one, so far fewer than one fdatasync per
    store (one each, 32, would mean no group commit)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    b = open_backend(root, num_blocks=64, num_threads=4, sync_interval=0)
    syncs = []
    real_sync = type(b.io).sync

    def slow_sync(self):
        syncs.append(1)
        time.sleep(0.05)  # a slow disk: the other writers finish their data writes meanwhile
        real_sync(self)
    monkeypatch.setattr(type(b.io), "sync", slow_sync)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: write(b, [2 * i, 2 * i + 1], [2 * i, 2 * i + 1]), range(32)))
    assert len(b.committed()) == 64
    assert 1 <= len(syncs) <= 16, f"{len(syncs)} slab fdatasyncs for 32 concurrent stores: commits were not shared"
    b.close()
    b = open_backend(root, num_blocks=64)
    assert len(b.recover()) == 64
    assert read(b, [7, 40], [7, 40]) == [payload(7), payload(40)]
    b.close()


def _count_syncs(b, monkeypatch, fail_first: int = 0) -> list[int]:
    """Record each slab fdatasync of `b` (the first `fail_first` raise EIO)."""
    syncs: list[int] = []
    real_sync = type(b.io).sync

    def sync(self):
        syncs.append(1)
        if len(syncs) <= fail_first:
            raise OSError(errno.EIO, "Input/output error")
        real_sync(self)
    monkeypatch.setattr(type(b.io), "sync", sync)
    return syncs


def _wait_for(condition, seconds: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_sync_interval_zero_makes_every_store_durable_before_it_returns(root, monkeypatch):
    b = open_backend(root, sync_interval=0)
    syncs = _count_syncs(b, monkeypatch)
    for i in range(3):
        write(b, [i], [i])
        assert len(syncs) == i + 1  # one slab fdatasync per store, inside write_blocks
    b.close()


def test_background_sync_journals_at_once_and_syncs_later(root, monkeypatch):
    b = open_backend(root, sync_interval=3600)  # the syncer never wakes in this test
    syncs = _count_syncs(b, monkeypatch)
    write(b, [0, 1, 2], [0, 1, 2])
    assert syncs == [] and set(b.committed()) == {0, 1, 2}  # journalled, not yet fdatasync'ed
    assert read(b, [1], [1]) == [payload(1)]
    b.sync()
    assert len(syncs) == 1
    write(b, [3], [3])
    b.close()  # makes the rest durable
    assert len(syncs) == 2
    with pytest.raises(KVTierError, match="closed"):
        b.sync()
    b = open_backend(root)
    assert sorted(blk.block_id for _, blk in b.recover()) == [0, 1, 2, 3]
    assert read(b, [3, 0], [3, 0]) == [payload(3), payload(0)]
    b.close()


def test_background_syncer_runs_and_retries_a_failed_sync(root, monkeypatch, caplog):
    b = open_backend(root, sync_interval=0.02)
    syncs = _count_syncs(b, monkeypatch, fail_first=1)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        write(b, [5], [5])
        assert _wait_for(lambda: len(syncs) >= 2 and not b.unsynced)  # failed once, then done
    assert "background fdatasync failed" in caplog.text and "Input/output error" in caplog.text
    count = len(syncs)
    assert not _wait_for(lambda: len(syncs) > count, seconds=0.2)  # nothing new: no sync
    assert read(b, [5], [5]) == [payload(5)]
    b.close()


def test_payload_checksum_is_zlib_crc32_whichever_library_computes_it():
    import zlib

    from kvtier.tiers.file.backend import payload_crc32

    data = payload(1, 3 * BLOCK)
    assert payload_crc32(data) == zlib.crc32(data)
    assert payload_crc32(memoryview(data)[BLOCK:]) == zlib.crc32(data[BLOCK:])


def test_auto_io_is_posix_without_gpu_and_kvikio_failure_falls_back(root, monkeypatch, caplog):
    b = open_backend(root, io="auto")
    real_gds = fileio.gpu_present() and fileio.gds_platform() and fileio.kvikio_importable()
    assert b.io.name == ("kvikio" if real_gds else "posix")
    b.close()

    class Broken(fileio.BlockIO):
        def __init__(self, path, num_threads):
            self.closed = False

        def pread(self, offset, buf):
            raise RuntimeError("libcuda.so.1: cannot open shared object file")

        pwrite = sync = lambda self, *a: None

        def close(self):
            self.closed = True

    monkeypatch.setattr(fileio, "gpu_present", lambda: True)
    monkeypatch.setattr(fileio, "gds_platform", lambda: True)
    monkeypatch.setattr(fileio, "kvikio_importable", lambda: True)
    monkeypatch.setattr(fileio, "KvikioIO", Broken)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        b = open_backend(root, io="auto")
    assert b.io.name == "posix" and any("kvikio unusable" in r.message for r in caplog.records)
    write(b, [0], [0])
    assert read(b, [0], [0]) == [payload(0)]
    b.close()


# ------------------------------------------------------------------ zero-copy path (page-aligned host slots)
def aligned_views(n, block_bytes=BLOCK):
    """Page-aligned writable slots, like the shared-memory CPU tier's."""
    arena = fileio.aligned_buffer(n * block_bytes)
    whole = memoryview(arena)
    return arena, [whole[i * block_bytes:(i + 1) * block_bytes] for i in range(n)]


def test_zero_copy_round_trip_and_integrity(root, monkeypatch):
    b = open_backend(root)
    calls = []
    for name in ("pwritev", "preadv", "pwrite", "pread"):
        real = getattr(type(b.io), name)
        monkeypatch.setattr(type(b.io), name,
                            lambda self, off, x, _n=name, _r=real: (calls.append(_n), _r(self, off, x))[1])
    _arena, src = aligned_views(4)
    for i, view in enumerate(src):
        view[:] = payload(i)
    b.write_blocks([3, 4, 5, 9], [key(i) for i in range(4)], src)
    _arena2, dst = aligned_views(4)
    b.read_blocks([3, 4, 5, 9], [key(i) for i in range(4)], dst)
    assert [bytes(v) for v in dst] == [payload(i) for i in range(4)]
    assert sorted(set(calls)) == ["preadv", "pwritev"]  # no bounce-buffer I/O
    with open(b.slab_path, "rb") as f:  # same on-disk image as the bounce path
        f.seek(4 * b.slot_bytes + HEADER_BYTES)
        assert f.read(BLOCK) == payload(1)
    flip(b.slab_path, 5 * b.slot_bytes + HEADER_BYTES + 3)
    with pytest.raises(IntegrityError, match="slot 5: payload checksum mismatch"):
        b.read_blocks([3, 4, 5], [key(i) for i in range(3)], dst[:3])
    assert bytes(dst[0]) == payload(0) and bytes(dst[1]) == payload(1)
    os.truncate(b.slab_path, 9 * b.slot_bytes)
    with pytest.raises(IntegrityError, match="truncated"):
        b.read_blocks([9], [key(3)], dst[3:])
    b.close()


def test_zero_copy_refused_falls_back_to_bounce(root, monkeypatch, caplog):
    b = open_backend(root)
    if not b.io.direct:
        pytest.skip("zero-copy is always possible with buffered I/O")

    def refuse(self, offset, iovs):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(type(b.io), "pwritev", refuse)
    monkeypatch.setattr(type(b.io), "preadv", refuse)
    _arena, views = aligned_views(2)
    views[0][:], views[1][:] = payload(0), payload(1)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        b.write_blocks([0, 1], [key(0), key(1)], views)
        b.write_blocks([2], [key(2)], [views[0]])
    assert len([r for r in caplog.records if "scatter-gather" in r.message]) == 1
    assert read(b, [0, 1], [0, 1]) == [payload(0), payload(1)]
    b.close()


def test_vector_io_finishes_partial_transfers(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(bytes(64))
    posix = fileio.PosixIO(str(path), direct=False)
    real = os.pwritev
    monkeypatch.setattr(fileio.os, "pwritev", lambda fd, iovs, off: real(fd, [bytes(iovs[0])[:3]], off))
    posix.pwritev(10, [b"abcd", b"efghij"])
    monkeypatch.setattr(fileio.os, "pwritev", real)
    out = [bytearray(5), bytearray(5)]
    posix.preadv(10, out)
    assert bytes(out[0] + out[1]) == b"abcdefghij"
    with pytest.raises(OSError, match="short read"):
        posix.preadv(60, [bytearray(8)])
    posix.close()


def test_auto_io_is_posix_on_a_gpu_without_gpudirect_storage(root, monkeypatch):
    """kvikio without nvidia-fs runs in compatibility mode, bouncing through its own buffers: no
    faster than O_DIRECT from host memory, so `auto` does not take it (issue 25, item 3)."""
    opened = []

    class Recording(fileio.BlockIO):
        name = "kvikio stand-in"

        def __init__(self, path, num_threads):
            opened.append(path)

        def pread(self, offset, buf):
            pass

        pwrite = sync = close = lambda self, *a: None

    monkeypatch.setattr(fileio, "gpu_present", lambda: True)
    monkeypatch.setattr(fileio, "gds_platform", lambda: False)
    monkeypatch.setattr(fileio, "kvikio_importable", lambda: True)
    monkeypatch.setattr(fileio, "KvikioIO", Recording)
    b = open_backend(root, io="auto")
    try:
        assert b.io.name == "posix" and opened == []
    finally:
        b.close()


def test_close_whose_pid_erase_fails_still_releases_the_lock_and_its_file(root, monkeypatch):
    """Erasing the pid from the lock file is the last step of a clean close: when it fails, the
    error is raised, but the lock is released and its descriptor closed all the same."""
    from kvtier.tiers.file import rootdir

    b = open_backend(root)

    def failing(fd, length):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(rootdir.os, "ftruncate", failing)
    with pytest.raises(OSError, match="Input/output error"):
        b.close()
    monkeypatch.undo()
    assert _open_fds_under(root) == []
    open_backend(root).close()  # the lock was released


@pytest.mark.parametrize("buffers", ["unaligned", "page-aligned"])
def test_a_slab_cut_inside_a_slot_fails_that_slot_alone(root, buffers):
    """Adjacent slots are read as one run: a slab cut inside the last of them fails that slot
    alone ("slab truncated"), the others are read and verified, through a bounce buffer or
    straight into page-aligned buffers (on 7e6c7c1 the whole run failed, so a job lost its good
    blocks with the cut one)."""
    import mmap

    b = open_backend(root)
    try:
        slots, keys = [3, 4, 5], [key(i) for i in range(3)]
        b.write_blocks(slots, keys, [payload(i) for i in range(3)])
        os.truncate(b.slab_path, 5 * b.slot_bytes + HEADER_BYTES + 100)
        out = [bytearray(BLOCK) if buffers == "unaligned" else mmap.mmap(-1, BLOCK) for _ in range(3)]
        with pytest.raises(IntegrityError, match="slab truncated") as failed:
            b.read_blocks(slots, keys, out)
        assert failed.value.slots == (5,)
        assert [bytes(o) for o in out[:2]] == [payload(0), payload(1)]
    finally:
        b.close()


def test_blocks_dropped_past_the_end_of_a_cut_slab_stay_dropped(root):
    """A slab cut inside a slot loses the blocks past its end at the next open; the journal is
    rewritten without them, so the open after that does not find them again over the zeros the
    re-extended slab holds there (on 7e6c7c1 they came back and failed their reads)."""
    b = open_backend(root)
    b.write_blocks([0, 1], [key(0), key(1)], [payload(0), payload(1)])
    b.close()
    os.truncate(b.slab_path, b.slot_bytes + HEADER_BYTES + 100)
    for _ in range(2):  # the open that drops them, and the one after it
        b = open_backend(root)
        try:
            assert sorted(b.committed()) == [0]
        finally:
            b.close()
