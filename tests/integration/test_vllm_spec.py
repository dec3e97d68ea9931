"""KVTierOffloadingSpec without an engine: vLLM's real config/spec/stats types, kvtier's real tiers.

Covers what the end-to-end test cannot see cheaply: config injection, the manager adapter's type
conversions (lookup results, specs, events with media and ownership, stats deltas), and a worker
round trip through the shared CPU region with blocks_per_chunk > 1 and a partly covered first chunk.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

PAGE = 1024  # bytes per engine block of the one KV tensor
BPC = 2  # engine blocks per offloaded block


def _config(tmp_path, events=True, kvtier_config=None, rank=0, world_size=1, engine_id=None, page=PAGE,
            blocks_per_chunk=BPC):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    kvtier_config = kvtier_config or {"block_tokens": 999, "tiers": [
        {"name": "cpu", "backend": "cpu", "capacity": "4 blocks", "cascade": "on_store"},
        {"name": "disk", "backend": "file", "root_dir": str(tmp_path / "disk"), "capacity": "16 blocks"}]}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=page, enable_kv_cache_events=events,
        extra_config={"kvtier_config": kvtier_config}, engine_id=engine_id or f"unit-{time.time_ns()}",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=rank, world_size=world_size, tp_size=world_size, pp_size=1,
                                          pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def _keys(n, start=0):
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


def _settle(manager, timeout=10.0):
    end = time.time() + timeout
    while manager.has_pending_work() and time.time() < end:
        manager.on_schedule_end(None)
        time.sleep(0.01)


@pytest.fixture
def spec(tmp_path):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    s = KVTierOffloadingSpec(_config(tmp_path))
    yield s
    s.shutdown()


def test_geometry_and_injected_options(spec, caplog):
    cfg = spec.hierarchy_config
    assert spec.block_tokens == 16 * BPC and cfg.block_tokens == 16 * BPC  # vLLM's, not the YAML's 999
    assert spec.block_bytes == PAGE * BPC
    assert cfg.tiers[0].options["shm_name"].startswith("kvtier-unit-")
    assert "tokens=32" in cfg.tiers[1].options["fingerprint"]


def test_inline_or_path_config(tmp_path):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    path = tmp_path / "k.yaml"
    path.write_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 2 blocks}\n")
    spec = KVTierOffloadingSpec(_config(tmp_path, kvtier_config=str(path)))
    assert [t.name for t in spec.hierarchy_config.tiers] == ["cpu"]
    with pytest.raises(ValueError, match="first tier must use backend 'cpu'"):
        KVTierOffloadingSpec(_config(tmp_path, kvtier_config={"tiers": [
            {"name": "disk", "backend": "file", "root_dir": str(tmp_path / "d"), "capacity": "2 blocks"}]}))


def test_manager_adapter_types_events_and_stats(spec):
    from vllm.v1.kv_offload.base import LookupResult, Medium, PrepareStoreOutput, ReqContext

    from kvtier.integrations.vllm import KVTierCPULoadStoreSpec, KVTierOffloadingSpec

    m = spec.get_manager()
    ctx = ReqContext("r0")
    keys = _keys(3)
    assert m.lookup(keys[0], ctx) is LookupResult.MISS
    out = m.prepare_store(keys, ctx)
    assert isinstance(out, PrepareStoreOutput) and isinstance(out.store_spec, KVTierCPULoadStoreSpec)
    assert out.keys_to_store == keys and len(out.store_spec.block_ids) == 3
    assert m.lookup(keys[0], ctx) is LookupResult.HIT_PENDING
    m.complete_store(keys, ctx)
    assert m.lookup(keys[0], ctx) is LookupResult.HIT
    _settle(m)  # on_store: the blocks are written down to the file tier too
    events = list(m.take_events())
    stored = {(e.medium, e.ownership) for e in events if not e.removed}
    assert (Medium.CPU, None) in stored and (Medium.STORAGE, "disk") in stored
    spec_out = m.prepare_load(keys[:2], ctx)
    assert isinstance(spec_out, KVTierCPULoadStoreSpec)
    m.complete_load(keys[:2], ctx)

    stats = m.get_stats()
    names = set(KVTierOffloadingSpec.build_metric_definitions({}))
    assert set(stats.data["data"]) <= names
    assert stats.data["data"]["vllm:kvtier_stores"][("cpu",)] == 3
    assert stats.data["data"]["vllm:kvtier_stores"][("disk",)] == 3
    assert "vllm:kvtier_stores" not in m.get_stats().data["data"]  # counters are deltas

    # Push the blocks out of the 4-slot CPU tier, then come back through the file tier (RETRY).
    more = _keys(4, start=10)
    m.complete_store(m.prepare_store(more, ctx).keys_to_store, ctx)
    _settle(m)
    assert m.lookup(keys[0], ctx) is LookupResult.RETRY
    _settle(m)
    assert m.lookup(keys[0], ctx) is LookupResult.HIT
    assert m.get_load_source(keys[0], ctx).value == "disk"


def test_worker_round_trip_through_shared_region(spec):
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        ReqContext,
    )

    m = spec.get_manager()
    engine = torch.randint(-128, 127, (8, PAGE), dtype=torch.int8)
    original = engine.clone()
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(engine, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])
    worker = spec.get_worker(caches)
    keys = _keys(2, start=100)
    out = m.prepare_store(keys, ReqContext("r"))
    # logical blocks 1..3 of a request (the first offloaded block is only half covered)
    gpu = GPULoadStoreSpec([5, 2, 7], group_sizes=[3], block_indices=[1])
    assert worker.submit_store(1, gpu, out.store_spec)
    worker.wait({1})
    (res,) = worker.get_finished()
    assert res.job_id == 1 and res.success and res.transfer_size == 3 * PAGE
    engine.zero_()
    assert worker.submit_load(2, out.store_spec, gpu, expedited=True)  # vLLM 0.33 keyword accepted
    assert worker.get_finished()[0].success
    for b in (5, 2, 7):
        assert torch.equal(engine[b], original[b])
    assert not engine[[0, 1, 3, 4, 6]].any()


def test_manager_calls_do_not_wait_for_the_file_tier(spec, monkeypatch):
    """With a file tier that takes 0.5 s per write, every scheduler-side call still returns at once;
    the blocks reach the file tier in the background."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.tiers.file import FileBackend

    real = FileBackend.write_blocks

    def slow_write(self, *args, **kwargs):
        time.sleep(0.5)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FileBackend, "write_blocks", slow_write)
    m = spec.get_manager()
    ctx = ReqContext("r")
    start = time.perf_counter()
    for i in range(2):  # 4 blocks: fits the CPU tier, nothing has to be evicted
        keys = _keys(2, start=200 + 2 * i)
        out = m.prepare_store(keys, ctx)
        m.complete_store(out.keys_to_store, ctx)
        m.on_schedule_end(None)
        m.lookup(keys[0], ctx)
    assert time.perf_counter() - start < 0.3
    assert m.has_pending_work()  # writes still running
    _settle(m)
    assert m.tier_stats()["disk"]["stores"] > 0


def test_a_load_makes_its_blocks_most_recently_used_when_its_request_ends(spec):
    """vLLM's connector never calls touch(); the adapter applies a request's loads when the
    request ends (as vLLM 0.32 does), so a reused block then outlives blocks stored after it."""
    from vllm.v1.kv_offload.base import ReqContext

    m = spec.get_manager()
    first, later = _keys(2), _keys(2, start=10)
    for i, group in enumerate((first, later)):  # the CPU tier (4 blocks) is now full: first is the oldest
        ctx = ReqContext(f"r-store-{i}")
        m.complete_store(m.prepare_store(group, ctx).keys_to_store, ctx)
        m.on_request_finished(ctx)
        _settle(m)  # written through to the file tier: nothing pinned
    ctx = ReqContext("r-lru")
    m.prepare_load(first, ctx)
    m.complete_load(first, ctx)
    m.on_request_finished(ctx)
    out = m.prepare_store(_keys(2, start=20), ReqContext("r-new"))
    assert out is not None and sorted(out.evicted_keys) == sorted(later)
    _settle(m)


def test_write_through_backpressure_is_exported_as_a_metric(spec):
    """Copies that wait for in-flight room count as `vllm:kvtier_cascade_deferred`, and vLLM is
    kept stepping (`has_pending_work`) until they are written."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.integrations.vllm import KVTierOffloadingSpec

    names = set(KVTierOffloadingSpec.build_metric_definitions({}))
    assert {"vllm:kvtier_cascade_deferred", "vllm:kvtier_cascade_dropped_failed",
            "vllm:kvtier_cascade_dropped_full"} <= names
    m = spec.get_manager()
    ctx = ReqContext("r-deferred")
    first, second = _keys(2, start=300), _keys(2, start=302)
    out1, out2 = m.prepare_store(first, ctx), m.prepare_store(second, ctx)
    m.complete_store(out1.keys_to_store, ctx)  # its copy starts: the in-flight limit (2) is used
    m.complete_store(out2.keys_to_store, ctx)  # waits for room
    data = m.get_stats().data["data"]
    assert data["vllm:kvtier_cascade_deferred"][("cpu",)] == 2
    assert m.has_pending_work()
    _settle(m)
    assert not m.has_pending_work()
    assert m.tier_stats()["disk"]["stores"] == 4 and m.tier_stats()["cpu"]["cascade_dropped"] == 0


def test_shutdown_copies_on_evict_blocks_down_so_a_restart_finds_them(tmp_path):
    """Under `on_evict` the CPU tier's blocks reach the file tier only when evicted; the adapter's
    shutdown flushes them (bounded), as a standalone close does, so the next engine finds them."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        ReqContext,
    )

    from kvtier.integrations.vllm import KVTierOffloadingSpec

    tiers = {"block_tokens": 999, "tiers": [
        {"name": "cpu", "backend": "cpu", "capacity": "4 blocks", "cascade": "on_evict"},
        {"name": "disk", "backend": "file", "root_dir": str(tmp_path / "disk"), "capacity": "16 blocks"}]}
    keys = _keys(2, start=300)
    engine = torch.randint(-128, 127, (8, PAGE), dtype=torch.int8)
    original = engine.clone()
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(engine, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])
    gpu = GPULoadStoreSpec([0, 1, 2, 3], group_sizes=[4], block_indices=[0])
    first = KVTierOffloadingSpec(_config(tmp_path, kvtier_config=tiers))
    m, worker = first.get_manager(), first.get_worker(caches)
    out = m.prepare_store(keys, ReqContext("r"))
    assert worker.submit_store(1, gpu, out.store_spec)
    worker.wait({1})
    assert worker.get_finished()[0].success
    m.complete_store(keys, ReqContext("r"))
    worker.shutdown()
    m.shutdown()

    second = KVTierOffloadingSpec(_config(tmp_path, kvtier_config=tiers))
    m2 = second.get_manager()
    try:
        end = time.time() + 10
        while (any(m2.lookup(k, ReqContext("r2")).name != "HIT" for k in keys)
               and time.time() < end):  # RETRY while the file tier's blocks come up
            _settle(m2, 0.5)
        assert [m2.lookup(k, ReqContext("r2")).name for k in keys] == ["HIT", "HIT"]
        engine.zero_()
        worker2 = second.get_worker(caches)
        worker2.submit_load(2, m2.prepare_load(keys, ReqContext("r2")), gpu)
        worker2.wait({2})
        assert worker2.get_finished()[0].success and torch.equal(engine[:4], original[:4])
        worker2.shutdown()
    finally:
        m2.shutdown()


def test_shutdown_closes_the_hierarchy_even_when_its_flush_raises(tmp_path, monkeypatch):
    """The flush at shutdown raising (a handler that cannot take the copy) still closes the
    hierarchy (its CPU region, files and threads) before the error goes on."""
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    m = KVTierOffloadingSpec(_config(tmp_path)).get_manager()
    closed = []
    real_close = m.hierarchy.close
    monkeypatch.setattr(m.hierarchy, "close", lambda: (closed.append(True), real_close()))
    monkeypatch.setattr(m.hierarchy.manager, "flush", lambda timeout: (_ for _ in ()).throw(RuntimeError("no copy")))
    with pytest.raises(RuntimeError, match="no copy"):
        m.shutdown()
    assert closed == [True]
