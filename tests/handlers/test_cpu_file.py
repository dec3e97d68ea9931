"""CPU <-> FILE through a full hierarchy (memory tier cascading into a file tier) and the handlers alone."""

from __future__ import annotations

import errno
import os
import threading

import pytest
from conftest import Jobs as RunJobs

from kvtier import (
    ConfigError,
    CPULoadStoreSpec,
    FileLoadStoreSpec,
    LookupResult,
    build_hierarchy,
    load_config_text,
    make_offload_key,
)
from kvtier.tiers.base import BlockFile, HostSlots
from kvtier.tiers.file.backend import HEADER_BYTES, FileBackend
from kvtier.tiers.memory import MemoryBackend
from kvtier.transfer.handlers.cpu_file import CPUToFileHandler, FileToCPUHandler, make_cpu_to_file, make_file_to_cpu

BLOCK = 64 * 1024


def config(root, mem_blocks=4, file_blocks=32, io="posix", upper="memory", reset=False):
    return load_config_text(f"""
block_tokens: 16
block_bytes: 64KiB
tiers:
  - name: mem
    backend: {upper}
    capacity: {mem_blocks} blocks
    policy: lru
    cascade: on_evict
    reserve: 0.25
  - name: disk
    backend: file
    root_dir: {root}
    capacity: {file_blocks} blocks
    policy: lru
    io: {io}
    fingerprint: test-model/layout-1
    num_threads: 2
    on_identity_change: {"reset" if reset else "refuse"}
""")


def keys(n, start=0):
    return [make_offload_key(i.to_bytes(8, "big") * 4, 0) for i in range(start, start + n)]


def payload(key: bytes) -> bytes:
    """Deterministic, key-specific block content."""
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def store(h, batch):
    mgr = h.manager
    out = mgr.prepare_store(batch)
    if out is None:  # room is being made by background demotions: let them land, then retry
        mgr.wait_idle()
        out = mgr.prepare_store(batch)
    assert out is not None
    mem = h.backends["mem"]
    for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
        mem.view(slot)[:] = payload(key)
    mgr.complete_store(out.keys_to_store)
    mgr.on_schedule_end()
    mgr.wait_idle()


def load(h, key) -> bytes:
    """lookup -> RETRY (promotion) -> HIT, then read the block from the memory tier."""
    mgr = h.manager
    first = mgr.lookup(key)
    if first == LookupResult.RETRY:
        mgr.on_schedule_end()
        mgr.wait_idle()
        assert mgr.lookup(key) == LookupResult.HIT
    else:
        assert first == LookupResult.HIT
    spec = mgr.prepare_load([key])
    data = bytes(h.backends["mem"].view(spec.block_ids[0]))
    mgr.complete_load([key])
    return data


@pytest.mark.parametrize("io,upper", [("posix", "memory"), ("kvikio", "memory"), ("posix", "cpu")])
def test_cascade_promotion_round_trip(tmp_path, io, upper):
    """`cpu` = the shared-memory CPU tier (page-aligned slots: the zero-copy path)."""
    if io == "kvikio":
        from kvtier.tiers.file.fileio import kvikio_importable

        if not kvikio_importable():
            pytest.skip("kvikio not installed")
        from tests.support.fake_cuda import load_fake_libcuda

        load_fake_libcuda()
    all_keys = keys(16)
    with build_hierarchy(config(tmp_path / "kv", io=io, upper=upper)) as h:
        assert h.backends["disk"].io.name == io
        for i in range(0, 16, 2):
            store(h, all_keys[i:i + 2])
        stats = h.manager.get_stats()
        assert stats["mem"]["demotions"] >= 12
        assert stats["disk"]["stores"] >= 12
        disk = h.backends["disk"]
        assert len(disk.committed()) == stats["disk"]["resident_blocks"]
        early = all_keys[0]
        assert h.manager.lookup(early) == LookupResult.RETRY  # only on disk: promoted first
        for key in all_keys:
            assert load(h, key) == payload(key)
        assert h.manager.get_stats()["disk"]["promotions"] >= 1


def test_restart_recovers_file_tier(tmp_path):
    all_keys = keys(12)
    with build_hierarchy(config(tmp_path / "kv")) as h:
        for i in range(0, 12, 3):
            store(h, all_keys[i:i + 3])
        on_disk = {k for k in all_keys if h.manager.tiers[1].policy.get(k) is not None}
    assert len(on_disk) >= 8
    with build_hierarchy(config(tmp_path / "kv")) as h:
        assert h.manager.get_stats()["disk"]["resident_blocks"] == len(on_disk)
        for key in sorted(on_disk):
            assert load(h, key) == payload(key)
        missing = [k for k in all_keys if k not in on_disk]
        for key in missing:
            assert h.manager.lookup(key) == LookupResult.MISS


def test_other_fingerprint_starts_empty(tmp_path, caplog):
    with build_hierarchy(config(tmp_path / "kv")) as h:
        for i in range(0, 8, 2):
            store(h, keys(2, i))
        assert h.manager.get_stats()["disk"]["resident_blocks"] > 0
    text = (tmp_path / "kv" / "manifest.json").read_text()
    (tmp_path / "kv" / "manifest.json").write_text(text.replace("test-model/layout-1", "other-model"))
    with pytest.raises(ConfigError, match="holds the blocks of another model"):  # by default: kept, refused
        build_hierarchy(config(tmp_path / "kv"))
    with caplog.at_level("WARNING", logger="kvtier.tiers.file"):
        with build_hierarchy(config(tmp_path / "kv", reset=True)) as h:
            assert h.manager.get_stats()["disk"]["resident_blocks"] == 0
            assert all(h.manager.lookup(k) == LookupResult.MISS for k in keys(8))
    assert sum("not ours" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_block_is_dropped_not_served(tmp_path, where):
    all_keys = keys(10)
    with build_hierarchy(config(tmp_path / "kv")) as h:
        for i in range(0, 10, 2):
            store(h, all_keys[i:i + 2])
    with build_hierarchy(config(tmp_path / "kv")) as h:
        disk = h.backends["disk"]
        victim = all_keys[0]
        slot = h.manager.tiers[1].policy.get(victim).block_id
        offset = slot * disk.slot_bytes + (HEADER_BYTES + 1000 if where == "payload" else 12)
        with open(disk.slab_path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))
        assert h.manager.lookup(victim) == LookupResult.RETRY
        h.manager.on_schedule_end()
        h.manager.wait_idle()
        assert h.manager.lookup(victim) == LookupResult.MISS
        assert h.manager.lookup(victim) == LookupResult.MISS  # gone from every tier
        assert h.manager.tiers[1].policy.get(victim) is None
        assert h.manager.get_stats()["disk"]["failures"] == 1
        assert slot not in disk.committed()
    with build_hierarchy(config(tmp_path / "kv")) as h:  # not recovered again either
        assert h.manager.tiers[1].policy.get(victim) is None


# ------------------------------------------------------------------ handlers alone
class Jobs:
    """Collects TransferResults reported by a handler."""

    def __init__(self, handler):
        self.results = {}
        self.done = threading.Condition()
        handler.bind(self._on_done)

    def _on_done(self, result):
        with self.done:
            self.results[result.job_id] = result
            self.done.notify_all()


def fail_first_io_call(monkeypatch, disk, names, error):
    """Make the first of `disk.io`'s calls named in `names` raise `error`; later calls go through.

    Both the bounce-buffer call and its zero-copy twin (`pwrite`/`pwritev`, `pread`/`preadv`) are
    patched: which one a run takes depends on the alignment the memory arena happened to get."""
    failed = []
    for name in names:
        real = getattr(type(disk.io), name)

        def once_failing(self, offset, buf, _real=real):
            if not failed:
                failed.append(offset)
                raise error
            return _real(self, offset, buf)

        monkeypatch.setattr(type(disk.io), name, once_failing)


@pytest.fixture
def pair(tmp_path):
    mem = MemoryBackend("mem", 8, BLOCK)
    disk = FileBackend("disk", 16, BLOCK, root_dir=str(tmp_path / "kv"), io="posix", num_threads=2,
                       fingerprint="test-model")
    yield mem, disk
    disk.close()
    mem.close()


def test_factories_need_both_sides(pair):
    mem, disk = pair
    assert make_cpu_to_file({"mem": mem}) is None
    assert make_file_to_cpu({"disk": disk}) is None
    handler = make_cpu_to_file({"mem": mem, "disk": disk})
    assert isinstance(handler, CPUToFileHandler)
    handler.shutdown()
    handler = make_file_to_cpu({"mem": mem, "disk": disk})
    assert isinstance(handler, FileToCPUHandler)
    handler.shutdown()


class HostOnly:
    """A third party's host-memory backend: `HostSlots` by its members, no kvtier base class."""

    def __init__(self, name, num_blocks, block_bytes):
        self.name, self.num_blocks, self.block_bytes = name, num_blocks, block_bytes
        self._slots = [bytearray(block_bytes) for _ in range(num_blocks)]

    def view(self, slot):
        return memoryview(self._slots[slot])


def test_handlers_serve_backends_by_declared_capability(pair):
    """Host side: any `HostSlots`; file side: any `BlockFile`; the rest is left out when the handler is built."""
    mem, disk = pair
    host = HostOnly("host", 4, BLOCK)
    assert isinstance(mem, HostSlots) and isinstance(host, HostSlots) and isinstance(disk, BlockFile)
    assert not isinstance(disk, HostSlots) and not isinstance(mem, BlockFile)
    store = make_cpu_to_file({"mem": mem, "host": host, "disk": disk})
    load = make_file_to_cpu({"mem": mem, "host": host, "disk": disk})
    assert sorted(store.hosts) == ["host", "mem"] and list(store.files) == ["disk"]
    ks = keys(2)
    host.view(3)[:] = payload(ks[0])
    jobs = RunJobs(store, load)
    assert jobs.run(store, 1, CPULoadStoreSpec([3], tier="host"), FileLoadStoreSpec([5], ks[:1], tier="disk")).success
    assert jobs.run(load, 2, FileLoadStoreSpec([5], ks[:1], tier="disk"), CPULoadStoreSpec([0], tier="mem")).success
    assert bytes(mem.view(0)) == payload(ks[0])
    jobs.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_io_error_fails_only_that_job(pair, monkeypatch, err):
    mem, disk = pair
    ks = keys(4)
    for i, k in enumerate(ks):
        mem.view(i)[:] = payload(k)
    put = make_cpu_to_file({"mem": mem, "disk": disk})
    get = make_file_to_cpu({"mem": mem, "disk": disk})
    puts, gets = Jobs(put), Jobs(get)
    fail_first_io_call(monkeypatch, disk, ("pwrite", "pwritev"), OSError(err, os.strerror(err)))
    put.submit(1, CPULoadStoreSpec([0, 1], tier="mem"), FileLoadStoreSpec([0, 1], ks[:2], tier="disk"))
    put.wait([1])
    put.submit(2, CPULoadStoreSpec([2, 3], tier="mem"), FileLoadStoreSpec([4, 5], ks[2:], tier="disk"))
    put.wait([2])
    with puts.done:
        puts.done.wait_for(lambda: len(puts.results) == 2)
    assert not puts.results[1].success and os.strerror(err) in puts.results[1].error
    assert puts.results[2].success and puts.results[2].transfer_size == 2 * BLOCK
    assert set(disk.committed()) == {4, 5}
    get.submit(3, FileLoadStoreSpec([4, 5], ks[2:], tier="disk"), CPULoadStoreSpec([6, 7], tier="mem"))
    get.wait([3])
    with gets.done:
        gets.done.wait_for(lambda: 3 in gets.results)
    assert gets.results[3].success
    assert bytes(mem.view(6)) == payload(ks[2]) and bytes(mem.view(7)) == payload(ks[3])
    put.shutdown()
    get.shutdown()


def test_read_eio_fails_job_then_recovers(pair, monkeypatch):
    mem, disk = pair
    ks = keys(2)
    disk.write_blocks([0, 1], ks, [payload(k) for k in ks])
    get = make_file_to_cpu({"mem": mem, "disk": disk})
    gets = Jobs(get)
    fail_first_io_call(monkeypatch, disk, ("pread", "preadv"), OSError(errno.EIO, "Input/output error"))
    get.submit(1, FileLoadStoreSpec([0, 1], ks, tier="disk"), CPULoadStoreSpec([0, 1], tier="mem"))
    get.wait([1])
    get.submit(2, FileLoadStoreSpec([0, 1], ks, tier="disk"), CPULoadStoreSpec([2, 3], tier="mem"))
    get.wait([2])
    with gets.done:
        gets.done.wait_for(lambda: len(gets.results) == 2)
    assert not gets.results[1].success and "Input/output error" in gets.results[1].error
    assert gets.results[2].success
    assert bytes(mem.view(2)) == payload(ks[0]) and bytes(mem.view(3)) == payload(ks[1])
    get.shutdown()
