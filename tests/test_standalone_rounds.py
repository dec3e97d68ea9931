"""The standalone API loses nothing silently (issue 26): `store` goes in rounds of what the first
tier can take under every cascade mode, `flush`/`close` write the dirty blocks down so a restart
finds them, and `load` returns every block found, in rounds of the first tier's room."""

from __future__ import annotations

import pytest
from test_standalone import keys, make_kv, snapshot, wipe

from kvtier import load_config_text
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")

N = 40  # blocks stored by one call, into a first tier of 16


def cpu_file(root, cascade, cpu_blocks=16):
    return load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: {cpu_blocks} blocks, pin: false, cascade: {cascade}}}
  - {{name: nvme, backend: file, root_dir: {root}, capacity: 128 blocks}}
""")


def assert_loads_all(tier, kv, before, ks):
    wipe(kv)
    assert tier.load(ks, list(range(N, 2 * N))) == len(ks)
    for t, b in zip(kv.tensors, before):
        assert torch.equal(t.tensor[N:2 * N], b[:N])


@pytest.mark.parametrize("cascade", ["on_store", "on_evict"])
def test_one_store_larger_than_the_first_tier_keeps_every_block(tmp_path, cascade):
    """40 blocks into a 16-block CPU tier in one call: all stored (rounds of its room), none dropped;
    one load of the 40 returns all of them (24 or more straight from the file tier)."""
    kv = make_kv(num_blocks=2 * N)
    ks = keys(N)
    with KVTier.open(cpu_file(tmp_path / "nvme", cascade), kv, model="test/rounds") as tier:
        assert tier.store(ks, list(range(N)))
        tier.wait()
        stats = tier.stats()
        assert stats["cpu"]["cascade_dropped"] == 0 and stats["nvme"]["resident_blocks"] >= N - 16
        assert_loads_all(tier, kv, snapshot(kv), ks)


def test_cascade_none_keeps_what_fits_and_says_so_by_its_counters(tmp_path):
    """Cascade `none` evicts by design: a store of 40 into 16 stores every round (True) and keeps 16."""
    kv = make_kv(num_blocks=2 * N)
    ks = keys(N)
    with KVTier.open(cpu_file(tmp_path / "nvme", "none"), kv, model="test/rounds") as tier:
        assert tier.store(ks, list(range(N)))
        assert tier.stats()["cpu"]["resident_blocks"] == 16
        assert sum(tier.lookup([k]) for k in ks) == 16  # (which 16: the policy's choice)


@pytest.mark.parametrize("cascade", ["on_store", "on_evict"])
def test_close_flushes_so_a_restart_finds_every_block(tmp_path, cascade):
    kv = make_kv(num_blocks=2 * N)
    ks = keys(N)
    before = snapshot(kv)
    with KVTier.open(cpu_file(tmp_path / "nvme", cascade), kv, model="test/rounds") as tier:
        assert tier.store(ks, list(range(N)))
    with KVTier.open(cpu_file(tmp_path / "nvme", cascade), kv, model="test/rounds") as tier:
        assert tier.stats()["nvme"]["resident_blocks"] == N
        assert_loads_all(tier, kv, before, ks)


def test_flush_writes_the_dirty_blocks_down_and_reports_none_left(tmp_path):
    kv = make_kv(num_blocks=2 * N)
    with KVTier.open(cpu_file(tmp_path / "nvme", "on_evict", cpu_blocks=64), kv, model="test/rounds") as tier:
        assert tier.store(keys(N), list(range(N)))
        assert tier.stats()["nvme"]["resident_blocks"] == 0  # all fit in the CPU tier: nothing below yet
        assert tier.flush(timeout=30) == 0
        assert tier.stats()["nvme"]["resident_blocks"] == N
        assert tier.flush() == 0  # nothing left to write


def test_close_without_flush_keeps_the_old_behaviour(tmp_path):
    kv = make_kv(num_blocks=2 * N)
    cfg = cpu_file(tmp_path / "nvme", "on_evict", cpu_blocks=64)
    with KVTier.open(cfg, kv, model="test/rounds") as tier:
        assert tier.store(keys(N), list(range(N)))
        tier.close(flush=False)
    with KVTier.open(cfg, kv, model="test/rounds") as tier:
        assert tier.stats()["nvme"]["resident_blocks"] == 0


def test_load_through_a_memory_tier_returns_every_block(tmp_path):
    kv = make_kv(num_blocks=2 * N)
    cfg = load_config_text("""
tiers:
  - {name: cpu, backend: cpu, capacity: 16 blocks, pin: false}
  - {name: warm, backend: memory, capacity: 128 blocks}
""")
    ks = keys(N)
    with KVTier.open(cfg, kv) as tier:
        assert tier.store(ks, list(range(N)))
        tier.wait()
        assert_loads_all(tier, kv, snapshot(kv), ks)


def test_load_through_a_valkey_tier_returns_every_block(valkey_server):
    """The valkey tier supplies its blocks by promotion into the 16-block first tier (no handler
    loads them straight into the KV caches): one load of 40 still returns 40."""
    kv = make_kv(num_blocks=2 * N)
    cfg = load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: 16 blocks, pin: false}}
  - {{name: shared, backend: valkey, capacity: 1000 blocks, url: '{valkey_server.url}',
      key_prefix: 'kvt:rounds', timeout_ms: 2000}}
""")
    ks = keys(N, start=7000)
    with KVTier.open(cfg, kv, model="test/rounds") as tier:
        assert tier.store(ks, list(range(N)))
        tier.wait()
        assert tier.stats()["cpu"]["resident_blocks"] == 16
        assert_loads_all(tier, kv, snapshot(kv), ks)
        assert tier.stats()["shared"]["promotions"] >= N - 16


def test_store_threshold_keeps_one_time_blocks_out(tmp_path):
    """The config's `store_threshold` holds under the standalone API too (before, only the vLLM
    front-ends applied it: a standalone store ignored it). Each `store` call is one offer."""
    config = load_config_text("""
store_threshold: 2
tiers:
  - {name: cpu, backend: cpu, capacity: 16 blocks, pin: false}
""")
    kv = make_kv(num_blocks=8)
    ks = keys(4)
    with KVTier.open(config, kv) as tier:
        assert tier.store(ks[:2], [0, 1])  # the first offer of ks[0:2]: skipped, not a failure
        assert tier.lookup(ks) == 0 and tier.stats()["engine"]["stores_skipped"] == 2
        assert tier.store(ks, [0, 1, 2, 3])  # the second offer of ks[0:2]: stored; ks[2:4] skipped
        assert tier.lookup(ks) == 2
        engine = tier.stats()["engine"]
        assert engine["stores_skipped"] == 4 and engine["stores"] == 2
