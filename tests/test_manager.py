"""HierarchyManager across two memory tiers that carry real bytes."""

import logging
import threading
import time

import pytest
from conftest import keys, memory_hierarchy

from kvtier import CompositeLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec, LookupResult, TransferResult
from kvtier.core.errors import KVTierError, WaitTimeout
from kvtier.transfer.handlers.base import SyncHandler, TransferHandler


def store(h, ks, ctx, fill=True):
    out = h.manager.prepare_store(ks, ctx)
    assert out is not None
    if fill:
        hot = h.backends["hot"]
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            hot.view(slot)[:] = (key * 8)[: hot.block_bytes]
    h.manager.complete_store(out.keys_to_store, ctx)
    return out


def read(h, key, ctx):
    """Look a key up until it is HIT (pumping steps), load it and return its bytes."""
    m = h.manager
    for _ in range(5):
        result = m.lookup(key, ctx)
        if result is LookupResult.HIT:
            break
        assert result is LookupResult.RETRY, result
        m.on_schedule_end()
    else:
        pytest.fail("block never came back")
    spec = m.prepare_load([key], ctx)
    data = bytes(h.backends[spec.tier].view(spec.block_ids[0]))
    m.complete_load([key], ctx)
    return data


def test_evicted_blocks_cascade_and_come_back_byte_identical(ctx):
    h = memory_hierarchy(hot=8, warm=32)
    ks = keys(24)
    for i in range(0, 24, 4):
        store(h, ks[i:i + 4], ctx)
        h.manager.on_schedule_end()
    stats = h.manager.get_stats()
    assert stats["hot"]["evictions"] == 16 and stats["hot"]["cascade_dropped"] == 0
    assert stats["warm"]["resident_blocks"] >= 16
    for key in ks:
        assert read(h, key, ctx) == (key * 8)[:64]
    stats = h.manager.get_stats()
    assert stats["warm"]["promotions"] >= 16 and stats["warm"]["hits"] >= 16
    h.close()


def test_staged_promotion_answers_retry_until_the_block_lands(ctx):
    h = memory_hierarchy(hot=4, warm=16)
    ks = keys(8)
    store(h, ks[:4], ctx)
    store(h, ks[4:], ctx)  # ks[:4] demoted then evicted
    assert h.manager.lookup(ks[0], ctx) is LookupResult.RETRY
    assert h.manager.lookup(ks[0], ctx) is LookupResult.RETRY  # queued, not started twice
    h.manager.on_schedule_end()
    assert h.manager.lookup(ks[0], ctx) is LookupResult.HIT
    h.close()


def test_block_being_written_is_hit_pending_and_never_evicted(ctx):
    h = memory_hierarchy(hot=4, warm=8, cascade="none")
    ks = keys(6)
    h.manager.prepare_store(ks[:4], ctx)  # not completed: ref_cnt -1
    assert h.manager.lookup(ks[0], ctx) is LookupResult.HIT_PENDING
    assert h.manager.prepare_store(ks[4:], ctx) is None
    h.close()


def test_pinned_blocks_are_not_evicted_and_unpinned_later(ctx):
    h = memory_hierarchy(hot=2, warm=8, cascade="none")
    ks = keys(3)
    store(h, ks[:2], ctx)
    h.manager.prepare_load(ks[:2], ctx)
    assert h.manager.prepare_store([ks[2]], ctx) is None
    h.manager.complete_load(ks[:2], ctx)
    assert h.manager.prepare_store([ks[2]], ctx) is not None
    h.close()


def test_prepare_store_skips_blocks_already_in_tier0(ctx):
    h = memory_hierarchy()
    ks = keys(3)
    store(h, ks[:2], ctx)
    out = h.manager.prepare_store(ks, ctx)
    assert out.keys_to_store == [ks[2]] and out.evicted_keys == []
    h.close()


def test_failed_store_frees_slots(ctx):
    h = memory_hierarchy(hot=2)
    ks = keys(2)
    h.manager.prepare_store(ks, ctx)
    h.manager.complete_store(ks, ctx, success=False)
    assert h.manager.lookup(ks[0], ctx) is LookupResult.MISS
    assert h.backends["hot"].get_num_free_blocks() == 2
    h.close()


def test_a_dropped_clean_block_no_longer_counts_as_room(ctx):
    """A block of tier 0 whose copy below exists, then dropped (a failed or reset load): its slot
    is free, and it is no longer counted among the clean blocks (`store_room` would count it twice)."""
    h = memory_hierarchy(hot=8, warm=32)
    m = h.manager
    ks = keys(4)
    store(h, ks, ctx)
    assert m.flush(timeout=30) == 0
    assert m.tiers[0].clean == set(ks) and m.stores.room() == 8  # 4 free + 4 clean
    m.prepare_load(ks[:1], ctx)
    assert m.finish_reset((), ks[:1]) == ks[:1]
    assert m.tiers[0].clean == set(ks[1:])
    assert m.stores.room() == 8  # 5 free + 3 clean: never more than the tier holds
    h.close()


def test_write_through_copies_every_completed_store_down(ctx):
    h = memory_hierarchy(hot=8, warm=8, cascade="on_store")
    ks = keys(3)
    store(h, ks, ctx)
    h.manager.on_schedule_end()
    warm = h.manager.tiers[1]
    assert all(warm.policy.get(k) is not None and warm.policy.get(k).is_ready for k in ks)
    assert h.manager.tiers[0].clean == set(ks)
    h.close()


@pytest.mark.parametrize("policy", ["kvtier.policies.lru_pure:PureLRUCachePolicy", "lru"], ids=["pure", "compiled"])
def test_engine_stores_name_the_request_tail_and_promotions_name_none(ctx, policy):
    """The `CachePolicy.insert_many` contract: a request's new blocks go in tail first with
    `tail=` its last new block; blocks copied in from another tier carry no tail. Every policy gets
    them through the tier's block table's `insert_written` (`PolicyTable` over the pure-Python
    one; the compiled policy's own `CompactTable`)."""
    h = memory_hierarchy(hot=4, warm=16, hot_policy=policy)
    calls = []

    class Spy:
        """The tier's table, with its `insert_written` calls recorded."""

        def __init__(self, table):
            self.table = table

        def __getattr__(self, name):
            return getattr(self.table, name)

        def __len__(self):
            return len(self.table)

        def insert_written(self, ks, blocks, tail=None):
            calls.append((list(ks), tail))
            return self.table.insert_written(ks, blocks, tail=tail)

    h.first_tier.table = Spy(h.first_tier.table)
    ks = keys(8)
    store(h, ks[:4], ctx)
    store(h, ks[4:], ctx)  # ks[:4] go down
    assert calls == [(ks[3::-1], ks[3]), (ks[:3:-1], ks[7])]
    calls.clear()
    assert read(h, ks[0], ctx) == (ks[0] * 8)[:64]  # promoted into tier 0 first
    assert calls == [([ks[0]], None)]
    h.close()


def test_events_are_per_medium_and_tier(ctx):
    h = memory_hierarchy(hot=2, warm=8, enable_events=True)
    ks = keys(4)
    store(h, ks[:2], ctx)
    store(h, ks[2:], ctx)
    events = list(h.manager.take_events())
    stored_warm = [e for e in events if e.tier == "warm" and not e.removed]
    removed_hot = [e for e in events if e.tier == "hot" and e.removed]
    assert sorted(k for e in stored_warm for k in e.keys) == sorted(ks[:2])
    assert sorted(k for e in removed_hot for k in e.keys) == sorted(ks[:2])
    assert all(e.medium == "CPU" for e in events)
    h.close()


class _WarmToEngine(SyncHandler):
    """A stand-in direct path: 'loads' a warm block into the engine by recording it."""

    def __init__(self):
        super().__init__()
        self.loaded = []

    def copy(self, src, dst):
        self.loaded.append((src.tier, list(src.block_ids), list(dst.block_ids)))
        return 0


def test_direct_path_serves_lower_tier_without_promotion(ctx):
    from kvtier.control.manager import HierarchyManager, Tier
    from kvtier.policies import LRUCachePolicy
    from kvtier.tiers.file.spec import FileLoadStoreSpec
    from kvtier.tiers.memory import MemoryBackend
    from kvtier.transfer.handlers.memory import MemoryCopyHandler
    from kvtier.transfer.router import TransferRouter

    class WarmBackend(MemoryBackend):  # addressed by its own spec type, as a file tier would be
        spec_type = FileLoadStoreSpec

        def get_load_store_spec(self, ks, blocks):
            return FileLoadStoreSpec([b.block_id for b in blocks], list(ks), tier=self.name)

    hot, warm = MemoryBackend("hot", 2, 8), WarmBackend("warm", 8, 8)
    router = TransferRouter()
    copier = MemoryCopyHandler({"hot": hot, "warm": warm})
    router.register(CPULoadStoreSpec, FileLoadStoreSpec, copier)
    router.register(FileLoadStoreSpec, CPULoadStoreSpec, copier)
    direct = _WarmToEngine()
    router.register(FileLoadStoreSpec, GPULoadStoreSpec, direct)
    router.register(CPULoadStoreSpec, GPULoadStoreSpec, direct)
    m = HierarchyManager([Tier("hot", hot, LRUCachePolicy(2), reserve_fraction=0.5),
                          Tier("warm", warm, LRUCachePolicy(8))], router)
    ks = keys(4)
    for pair in (ks[:2], ks[2:]):
        m.complete_store(m.prepare_store(pair, ctx).keys_to_store, ctx)
    assert [m.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 4  # ks[:2] from warm, directly
    spec = m.prepare_load(ks, ctx)
    assert isinstance(spec, CompositeLoadStoreSpec)
    assert sorted(tuple(p) for _, p in spec.parts) == [(0, 1), (2, 3)]
    # A multi-tier load is submitted part by part (GPU specs cannot be split by key position).
    engine_blocks = [10, 11, 12, 13]
    whole = router.submit(spec, GPULoadStoreSpec(engine_blocks))
    assert [r.success for r in router.poll() if r.job_id == whole] == [False]
    jobs = [router.submit(part, GPULoadStoreSpec([engine_blocks[p] for p in pos])) for part, pos in spec.parts]
    assert sorted(r.job_id for r in router.poll() if r.success) == sorted(jobs)
    warm_slots = [warm_block(m, k).block_id for k in ks[:2]]
    assert sorted(direct.loaded) == sorted([("warm", warm_slots, [10, 11]),
                                            ("hot", [m.tiers[0].policy.get(k).block_id for k in ks[2:]], [12, 13])])
    m.complete_load(ks, ctx)
    assert m.get_stats()["warm"]["hits"] == 2 and m.get_stats()["warm"]["promotions"] == 0


def warm_block(m, key):
    return m.tiers[1].policy.get(key)


def test_failed_promotion_drops_the_lower_copy_and_answers_miss(ctx):
    h = memory_hierarchy(hot=2, warm=8)
    ks = keys(4)
    store(h, ks[:2], ctx)
    store(h, ks[2:], ctx)
    handler = h.router.handler_for(CPULoadStoreSpec, CPULoadStoreSpec)
    original = handler.copy
    handler.copy = lambda src, dst: (_ for _ in ()).throw(OSError(5, "injected EIO"))
    assert h.manager.lookup(ks[0], ctx) is LookupResult.RETRY
    h.manager.on_schedule_end()
    assert h.manager.lookup(ks[0], ctx) is LookupResult.MISS
    assert h.manager.tiers[1].policy.get(ks[0]) is None
    assert h.manager.get_stats()["warm"]["failures"] >= 1  # the promotion (and any demotion tried meanwhile)
    handler.copy = original
    assert read(h, ks[1], ctx) == (ks[1] * 8)[:64]  # later jobs succeed
    h.close()


def test_slow_lower_tier_applies_backpressure_without_dropping_blocks(ctx):
    """Demotions that never finish cap the blocks in flight; stores into tier 0 are answered at
    once: with room while free slots last, then None (no room yet) rather than dropping a block
    not copied down; nothing pinned is evicted, nothing is lost."""
    from kvtier.transfer.handlers.base import TransferHandler

    class Stuck(TransferHandler):
        def __init__(self):
            super().__init__()
            self.jobs = []

        def submit(self, job_id, src, dst):
            self.jobs.append(job_id)

    h = memory_hierarchy(hot=20, warm=100, reserve=0.1)
    h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, Stuck())
    ks = keys(200)
    answered = 0
    for i in range(0, 200, 2):
        out = h.manager.prepare_store(ks[i:i + 2], ctx)
        if out is not None:
            h.manager.complete_store(out.keys_to_store, ctx)
            answered += 1
        h.manager.on_schedule_end()
    hot = h.manager.tiers[0]
    assert hot.demoting <= 4  # two reserves of 2 blocks (one burst may exceed it only when none is in flight)
    assert hot.stats.cascade_deferred > 0 and hot.stats.cascade_dropped == hot.stats.evictions == 0
    assert answered == 10 and len(hot.policy) == 20  # the 20 slots filled, then no room: refused
    pinned = [k for k in hot.policy.keys() if hot.policy.get(k).ref_cnt > 0]
    assert len(pinned) == hot.demoting


@pytest.mark.parametrize("policy", ["lru", "arc", "sieve", "prefix-freq"])
def test_cascade_loses_nothing_when_the_lower_tier_keeps_up(policy):
    """With handlers that finish at once, every block evicted from tier 0 (by stores or by
    promotions) was copied down first, whatever order the policy evicts in."""
    from kvtier.bench.replay import replay_manager
    from kvtier.bench.workloads import generate_trace

    h = memory_hierarchy(hot=64, warm=4096, hot_policy=policy, dry_run=True)
    result = replay_manager(h.manager, generate_trace(num_conversations=80, seed=3))
    hot = h.manager.get_stats()["hot"]
    assert hot["evictions"] > 500 and hot["cascade_dropped"] == 0
    assert h.manager.get_stats()["warm"]["promotions"] > 0 and result["hit_rate"] > 0.5
    h.close()


def test_load_source_names_the_tier_that_supplied_a_promoted_block(ctx):
    h = memory_hierarchy(hot=4, warm=16)
    ks = keys(8)
    store(h, ks[:4], ctx)
    store(h, ks[4:], ctx)  # ks[:4] now only in warm
    m = h.manager
    assert m.load_source(ks[5]) == "CPU" and m.load_source(b"missing") is None
    assert m.lookup(ks[0], ctx) is LookupResult.RETRY
    m.on_schedule_end()
    assert m.lookup(ks[0], ctx) is LookupResult.HIT
    m.tiers[1].backend.medium = "FILE"  # tell the two memory tiers apart
    assert m.load_source(ks[0]) == "FILE"  # promoted: supplied by the lower tier
    m.prepare_load([ks[0]], ctx)
    m.complete_load([ks[0]], ctx)
    assert m.load_source(ks[0]) == "CPU"  # loaded once: now a tier-0 block like any other
    h.close()


class HungHandler(TransferHandler):
    """Accepts jobs and reports none until `finish_all`; its `wait` and `shutdown` block until
    then, like a thread pool whose copy hangs."""

    def __init__(self):
        self.jobs = []
        self.released = threading.Event()

    def submit(self, job_id, src, dst):
        self.jobs.append(job_id)

    def wait(self, job_ids):
        self.released.wait()

    def shutdown(self):
        self.released.wait()

    def finish_all(self):
        self.released.set()
        for job_id in self.jobs:
            self.report(TransferResult(job_id, False, 0, 0.0, error="released"))


def hung_hierarchy(ctx):
    """Write-through memory tiers whose copy below never ends: one demotion of 2 blocks hangs."""
    h = memory_hierarchy(hot=8, warm=8, cascade="on_store")
    hung = HungHandler()
    h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, hung)
    store(h, keys(2), ctx)
    assert h.manager.has_pending_work() and hung.jobs
    return h, hung


def test_wait_idle_with_a_timeout_names_the_jobs_a_hung_handler_holds(ctx):
    h, hung = hung_hierarchy(ctx)
    began = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"1 transfer job still running after 0.2 s") as info:
        h.manager.wait_idle(timeout=0.2)
    assert time.monotonic() - began < 10  # bounded, generously for a loaded machine
    assert info.value.jobs == [f"job {hung.jobs[0]}: demotion of 2 blocks hot -> warm"]
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, KVTierError)
    hung.finish_all()
    h.manager.wait_idle(timeout=5)  # the reports arrive: idle, no error
    assert not h.manager.has_pending_work()
    h.close()


def test_shutdown_abandons_jobs_of_a_hung_handler_after_its_timeout(ctx, caplog):
    h, hung = hung_hierarchy(ctx)
    closed = []
    for tier in h.manager.tiers:
        tier.backend.close = lambda name=tier.name: closed.append(name)
    began = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="kvtier.control.manager"):
        h.manager.shutdown(timeout=0.2)  # the router's shutdown would block in the hung handler
    assert time.monotonic() - began < 10
    assert closed == []  # both tiers are used by the abandoned copy: left open
    assert "shutdown abandoned 1 transfer job still running after 0.1 s" in caplog.text  # (0.1 s: the close's share)
    assert "demotion of 2 blocks hot -> warm" in caplog.text and "tiers hot, warm are left open" in caplog.text
    hung.finish_all()
    h.manager.shutdown(timeout=5)
    assert closed == ["hot", "warm"]
