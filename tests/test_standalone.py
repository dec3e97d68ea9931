"""The standalone API: a hierarchy around KV tensors, blocks stored and loaded by key."""

from __future__ import annotations

import os
import runpy
from pathlib import Path
from unittest.mock import Mock

import pytest

from kvtier import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    load_config_text,
    make_offload_key,
)
from kvtier.core.errors import ArgumentError
from kvtier.standalone import KVTier
from kvtier.tiers.file.backend import MAX_KEY_BYTES

torch = pytest.importorskip("torch")

PAGE = 4096


def make_kv(num_blocks=32, groups=1):
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randint(-128, 128, (num_blocks, PAGE), dtype=torch.int8, generator=g) for _ in range(2)]
    refs = [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)] for _ in range(groups)]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors], refs)


def keys(n, start=0, group=0):
    return [make_offload_key(i.to_bytes(16, "big"), group) for i in range(start, start + n)]


def cpu_file(tmp_path, cpu_blocks=4, file_blocks=64):
    return load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: {cpu_blocks} blocks, pin: false}}
  - {{name: nvme, backend: file, root_dir: {tmp_path / 'nvme'}, capacity: {file_blocks} blocks}}
""")


def snapshot(kv):
    return [t.tensor.clone() for t in kv.tensors]


def wipe(kv):
    for t in kv.tensors:
        t.tensor.zero_()


def test_cpu_tier_roundtrip_and_lookup():
    kv = make_kv()
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 16 blocks, pin: false}\n")
    with KVTier.open(cfg, kv) as tier:
        ks = keys(6)
        assert tier.lookup(ks) == 0
        assert tier.store(ks, [3, 1, 4, 15, 9, 2])
        assert tier.store(ks[:2], [0, 0])  # already held: skipped, engine block 0 not read
        assert tier.lookup(ks) == 6 and tier.lookup(ks[:3] + keys(1, 100) + ks[3:]) == 3
        before = snapshot(kv)
        wipe(kv)
        assert tier.load(ks, [20, 21, 22, 23, 24, 25]) == 6
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[20:26], b[[3, 1, 4, 15, 9, 2]])
        stats = tier.stats()
        assert stats["cpu"]["hits"] == 6 and stats["engine"]["loads"] == 6 and stats["engine"]["stores"] == 6
        shm = tier.hierarchy.backends["cpu"].path
        assert os.path.exists(shm)
    assert not os.path.exists(shm)  # closed by the context manager


def test_cascade_to_file_and_load_back_byte_exact(tmp_path):
    kv = make_kv(num_blocks=40)
    with KVTier.open(cpu_file(tmp_path), kv, model="test-model") as tier:
        ks = keys(20)
        for start in range(0, 20, 5):
            assert tier.store(ks[start:start + 5], list(range(start, start + 5)))
        tier.wait()
        stats = tier.stats()
        assert stats["cpu"]["cascade_dropped"] == 0 and stats["nvme"]["resident_blocks"] >= 16
        before = snapshot(kv)
        wipe(kv)
        assert tier.load(ks, list(range(20, 40))) == 20
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[20:40], b[:20])


def test_file_tier_loads_straight_into_the_kv_caches(tmp_path):
    """The file tier's blocks are loaded by the worker plane's file->KV handler, without a
    promotion into the CPU tier (the builder tells the manager which tiers its worker plane reads)."""
    kv = make_kv(num_blocks=40)
    with KVTier.open(cpu_file(tmp_path), kv, model="test-model") as tier:
        ks = keys(12)
        assert tier.store(ks, list(range(12)))
        tier.wait()
        before = snapshot(kv)
        wipe(kv)
        assert tier.load(ks, list(range(20, 32))) == 12
        stats = tier.stats()
        assert stats["nvme"]["hits"] >= 8 and stats["nvme"]["promotions"] == 0
        assert stats["cpu"]["hits"] + stats["nvme"]["hits"] == 12
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[20:32], b[:12])


def test_groups_and_chunks(tmp_path):
    kv = make_kv(num_blocks=40, groups=2)
    with KVTier.open(cpu_file(tmp_path, cpu_blocks=3), kv, blocks_per_chunk=2, model="test-model") as tier:
        assert tier.layout.block_bytes == 2 * 2 * PAGE
        ks = [keys(3, group=1)[0], keys(3, group=0)[1], keys(3, group=1)[2], keys(3, group=0)[0]]
        ids = [1, 2, 3, 4, 5, 6, 7, 8]
        assert tier.store(ks, ids)
        tier.wait()
        before = snapshot(kv)
        wipe(kv)
        targets = list(range(30, 38))
        assert tier.load(ks, targets) == 4
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[30:38], b[1:9])
        with pytest.raises(ValueError, match="engine block ids"):
            tier.store(keys(1, 50), [1])


def test_failed_load_reports_zero(monkeypatch):
    """A load job that fails without naming a block (an I/O or copy error): none of its blocks is
    trusted: they are dropped from the tier they were read from, counted once each, and a MISS
    from then on; storing them again works."""
    kv = make_kv()
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks, pin: false}\n")
    with KVTier.open(cfg, kv) as tier:
        ks = keys(2)
        assert tier.store(ks, [1, 2])
        handler = tier.hierarchy.worker.handler_for(CPULoadStoreSpec, GPULoadStoreSpec)
        with monkeypatch.context() as patch:
            patch.setattr(handler, "copy", Mock(side_effect=OSError("injected copy failure")))
            assert tier.load(ks, [1, 3]) == 0  # the job failed
        stats = tier.stats()
        assert stats["engine"]["load_failures"] == 2 and stats["cpu"]["failures"] == 2
        assert tier.lookup(ks) == 0 and tier.load(ks, [5, 6]) == 0  # a MISS, not loaded again
        assert tier.store(ks, [1, 2]) and tier.load(ks, [5, 6]) == 2


def test_accepted_argument_forms():
    """Ids as numpy integers, a numpy array, an integer tensor, a range or a tuple, keys as bytearray,
    memoryview or any iterable: each means what the list of ints or of bytes would."""
    np = pytest.importorskip("numpy")
    kv = make_kv(num_blocks=40)
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 32 blocks, pin: false}\n")
    with KVTier.open(cfg, kv) as tier:
        ks = keys(12)
        forms = [(ks[0:2], [np.int64(1), np.uint8(2)]), (ks[2:4], np.array([3, 4], dtype=np.int32)),
                 (ks[4:6], torch.tensor([5, 6])), (ks[6:8], range(7, 9)),
                 ([bytearray(k) for k in ks[8:10]], (9, 10)), ((memoryview(k) for k in ks[10:12]), [11, 12])]
        for form_keys, form_ids in forms:
            assert tier.store(form_keys, form_ids)
        assert tier.store(keys(2, 50), [3, 3])  # one engine block stored under two keys: read twice
        before = snapshot(kv)
        wipe(kv)
        assert tier.lookup(iter(ks)) == 12
        assert tier.load(tuple(ks), torch.arange(20, 32, dtype=torch.int32)) == 12
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[20:32], b[1:13])


def test_key_limit_is_the_smallest_of_the_tiers(tmp_path):
    """A key as long as a file slot header holds goes down to the file tier and back; one byte more is
    refused at the call; with no file tier, a key of 4 KiB is held."""
    kv = make_kv(num_blocks=40)
    longest = [b"%03d" % i + b"k" * (MAX_KEY_BYTES - 3) for i in range(6)]
    with KVTier.open(cpu_file(tmp_path, cpu_blocks=2), kv, model="test-model") as tier:
        assert tier.store(longest, range(6))
        tier.wait()
        stats = tier.stats()
        assert stats["nvme"]["resident_blocks"] >= 4 and stats["nvme"]["failures"] == 0
        before = snapshot(kv)
        wipe(kv)
        assert tier.load(longest, range(10, 16)) == 6
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[10:16], b[0:6])
        with pytest.raises(ArgumentError, match=f"keys\\[0\\]: key of {MAX_KEY_BYTES + 1} bytes .* tier 'nvme'"):
            tier.store([longest[0] + b"k"], [0])
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 4 blocks, pin: false}\n")
    with KVTier.open(cfg, kv) as tier:
        assert tier.store([b"k" * 4096], [0]) and tier.load([b"k" * 4096], [1]) == 1


def test_a_key_longer_than_the_policy_holds_is_refused_before_a_slot_is_taken():
    """The compiled `lru` holds keys of up to `kvtier.core.limits.MAX_KEY_BYTES`: a longer one is an
    ArgumentError naming the policy's tier, and no slot is taken (before: the policy's ValueError
    from inside the store, one slot of the CPU tier lost)."""
    from kvtier.core.limits import MAX_KEY_BYTES as POLICY_KEY_BYTES

    kv = make_kv(num_blocks=4)
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 4 blocks, pin: false, policy: lru}\n")
    with KVTier.open(cfg, kv) as tier:
        with pytest.raises(ArgumentError, match=f"keys\\[0\\]: key of {POLICY_KEY_BYTES + 1} bytes .* "
                                                "the policy of tier 'cpu'"):
            tier.store([b"k" * (POLICY_KEY_BYTES + 1)], [0])
        assert tier.stats()["cpu"]["free_blocks"] == 4
        assert tier.store([b"k" * POLICY_KEY_BYTES], [0]) and tier.load([b"k" * POLICY_KEY_BYTES], [1]) == 1


def test_kv_rows_wider_than_the_page_are_accepted():
    """Blocks whose rows are padded (stride(0) > page) are contiguous runs: accepted, copied exactly."""
    wide = [torch.randint(-128, 128, (16, 2 * PAGE), dtype=torch.int8) for _ in range(2)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(w[:, :PAGE], PAGE) for w in wide])
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 4 blocks, pin: false}\n")
    with KVTier.open(cfg, kv) as tier:
        before = [w.clone() for w in wide]
        assert tier.store(keys(2), [1, 2]) and tier.load(keys(2), [5, 6]) == 2
        for w, b in zip(wide, before):
            assert torch.equal(w[5:7, :PAGE], b[1:3, :PAGE]) and torch.equal(w[5:7, PAGE:], b[5:7, PAGE:])


def test_packaged_memory_config(tmp_path):
    import kvtier.config

    kv = make_kv(num_blocks=40)
    memory_yaml = Path(kvtier.__file__).with_name("configs") / "memory.yaml"
    with KVTier.open(memory_yaml, kv) as tier:
        ks = keys(10)
        assert tier.store(ks, list(range(10)))
        before = snapshot(kv)
        wipe(kv)
        assert tier.load(ks, list(range(30, 40))) == 10
        for t, b in zip(kv.tensors, before):
            assert torch.equal(t.tensor[30:40], b[:10])


def test_example_runs(capsys):
    runpy.run_path(str(Path(__file__).parents[1] / "examples" / "standalone.py"), run_name="__main__")
    assert "loaded 24/24 blocks, bytes identical: True" in capsys.readouterr().out
