"""Counters that count each block once: a tier's `hits` are the blocks a load delivered (not a
block that failed, nor, in the standalone `load`, the blocks after it), and `cascade_deferred`
counts a block once per wait for in-flight room, however often the same victim is asked for.

Before the fix a hit was counted when the load was prepared (a block that then failed
verification was a hit, and so were the blocks the standalone `load` discarded after it), and
every refused `prepare_store` counted the same waiting victims again.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
from conftest import keys as manager_keys
from conftest import memory_hierarchy
from test_standalone import keys, make_kv

from kvtier import CPULoadStoreSpec, LookupResult, TransferResult, load_config_text
from kvtier.standalone import KVTier
from kvtier.tiers.file.slot_format import HEADER_BYTES
from kvtier.transfer.handlers.base import TransferHandler

pytest.importorskip("torch")


def _cpu_over_file(root) -> object:
    return load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: 4 blocks, pin: false}}
  - {{name: nvme, backend: file, root_dir: {root}, capacity: 32 blocks}}
""")


def _flip_payload(tier, key) -> None:
    """Flip one payload byte of `key`'s slot in file tier `tier`'s slab (it fails verification)."""
    backend = tier.backend
    at = tier.table.get(key).block_id * backend.slot_bytes + HEADER_BYTES + 100
    with open(backend.slab_path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))


def _scraped_hits(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^kvtier_tier_hits\{tier="(\w+)"\} (\S+)$', text, re.M)}


def test_standalone_load_counts_as_hits_only_the_prefix_it_returns(tmp_path):
    """The review's repro: 12 blocks stored (the first 8 only in the file tier, which the load
    reads directly), block 2's payload corrupted. `load` returns 2: blocks 0 and 1 are the file
    tier's hits; block 2 is a failure (not a hit) and block 3, copied in the same round and
    dropped by `load`, is neither. `stats()` and the metrics endpoint agree."""
    kv = make_kv(64)
    ks = keys(12)
    with KVTier.open(_cpu_over_file(tmp_path / "nvme"), kv, model="test/counted-once", metrics_port=0) as tier:
        assert tier.store(ks, list(range(12)))
        tier.wait()
        nvme = tier.manager.tiers[1]
        _flip_payload(nvme, ks[2])
        before = tier.stats()
        assert tier.load(ks, list(range(20, 32))) == 2
        after = tier.stats()
        delta = {name: {c: after[name][c] - before[name][c] for c in ("hits", "failures")} for name in ("cpu", "nvme")}
        assert delta == {"cpu": {"hits": 0, "failures": 0}, "nvme": {"hits": 2, "failures": 1}}
        assert after["engine"]["loads"] - before["engine"]["loads"] == 2
        assert _scraped_hits(tier.metrics_url) == {"cpu": after["cpu"]["hits"], "nvme": after["nvme"]["hits"]}
        # the blocks after the failed one were kept: loading them now counts them, once
        assert tier.load(ks[3:5], [40, 41]) == 2
        assert tier.stats()["nvme"]["hits"] - after["nvme"]["hits"] == 2


def _promoted(h, ks, ctx):
    """Bring `ks` (only in the warm tier) up into the hot tier by lookups (RETRY, then HIT)."""
    m = h.manager
    assert all(m.lookup(k, ctx) is LookupResult.RETRY for k in ks)
    m.on_schedule_end()
    assert all(m.lookup(k, ctx) is LookupResult.HIT for k in ks)


def _store(h, ks, ctx):
    out = h.manager.prepare_store(ks, ctx)
    h.manager.complete_store(out.keys_to_store, ctx)


def test_a_failed_load_of_promoted_blocks_credits_their_origin_for_the_delivered_ones_only(ctx):
    """Blocks promoted from the warm tier are the warm tier's hits when loaded. A load of four of
    them whose second one fails: the first is a warm hit; the failed one is the hot tier's failure
    (where it was read), no tier's hit; the two after it are no hit yet and, loaded later, are
    still credited to the warm tier that supplied them."""
    h = memory_hierarchy(hot=4, warm=16)
    m = h.manager
    ks = manager_keys(8)
    _store(h, ks[:4], ctx)
    _store(h, ks[4:], ctx)  # ks[:4] demoted, then evicted from the hot tier
    _promoted(h, ks[:4], ctx)
    m.prepare_load(ks[:4], ctx)
    m.complete_load(ks[:4], ctx, failed=[ks[1]])
    stats = m.get_stats()
    assert (stats["warm"]["hits"], stats["hot"]["hits"], stats["hot"]["failures"]) == (1, 0, 1)
    assert m.lookup(ks[1], ctx) is not LookupResult.HIT  # dropped from the hot tier
    m.prepare_load(ks[2:4], ctx)
    m.complete_load(ks[2:4], ctx)
    stats = m.get_stats()
    assert (stats["warm"]["hits"], stats["hot"]["hits"]) == (3, 0)
    h.close()


def test_a_load_flushed_by_a_cache_reset_counts_no_hit(ctx):
    """The engine never completes a load that a reset flushed: nothing was delivered."""
    h = memory_hierarchy(hot=8, warm=16)
    m = h.manager
    ks = manager_keys(3)
    _store(h, ks, ctx)
    m.prepare_load(ks, ctx)
    m.reset_cache()
    m.finish_reset([], ks)
    assert m.get_stats()["hot"]["hits"] == 0
    h.close()


class _Gate(TransferHandler):
    """Copies between memory tiers that finish (successfully, bytes not moved) only when opened."""

    def __init__(self):
        super().__init__()
        self.jobs: list[int] = []

    def submit(self, job_id, src, dst):
        self.jobs.append(job_id)

    def open(self):
        jobs, self.jobs = self.jobs, []
        for job_id in jobs:
            self.report(TransferResult(job_id, True, 0, 0.0))


def test_cascade_deferred_counts_each_waiting_block_once_per_wait(ctx):
    """A 20-block tier with a reserve of 2 (at most 4 copies down in flight), filled while its
    copies hang: each refused store starts no copy and defers the same next victims. They are
    counted once (2), not once per refusal; once the copies land and theirs start, the next
    victims to wait are counted (2 more)."""
    h = memory_hierarchy(hot=20, warm=100, reserve=0.1)
    gate = _Gate()
    h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, gate)
    m = h.manager
    hot = m.tiers[0]
    ks = manager_keys(200)

    def offer(start: int) -> bool:
        out = m.prepare_store(ks[start:start + 2], ctx)
        if out is not None:
            m.complete_store(out.keys_to_store, ctx)
        m.on_schedule_end()
        return out is not None

    assert all(offer(i) for i in range(0, 20, 2))
    assert not any(offer(100) for _ in range(20))  # no room yet, 20 times
    assert (hot.stats.cascade_deferred, hot.demoting, hot.stats.cascade_dropped) == (2, 4, 0)
    gate.open()
    m.on_schedule_end()
    answers = [offer(i) for i in range(100, 140, 2)]
    assert answers == [True] * 2 + [False] * 18
    assert (hot.stats.cascade_deferred, hot.demoting, hot.stats.demotions) == (4, 4, 4)
    assert m.get_stats()["hot"]["cascade_deferred"] == 4
    gate.open()
    h.close()
