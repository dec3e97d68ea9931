"""Direct file loads under vLLM, without an engine: vLLM's real spec/config types, kvtier's real
tiers, the connector's real scheduler side, and the worker over CPU tensors as KV cache.

With `KVTierOffloadingConnector` (failed loads are recomputed), a block found only in the file
tier is a HIT (no promotion, no RETRY), loaded by the worker straight from the file tier, which it
opens read-only itself, and verified there; a block that fails verification fails the job with the
KV cache untouched, and the failed load drops it from the file tier. That holds whatever process
the worker runs in and however many ranks (the worker in another process and TP = 2 are in
test_vllm_tp.py, with real rank processes). Otherwise (vLLM's own connector, `direct_file_loads:
false`) it is promoted through the CPU tier as before.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_spec import BPC, PAGE, _config, _keys, _settle  # noqa: E402

ENGINE_BLOCKS = 16


def _tiers(tmp_path, direct=None):
    tiers = {"tiers": [
        {"name": "cpu", "backend": "cpu", "capacity": "4 blocks", "cascade": "on_store"},
        {"name": "disk", "backend": "file", "root_dir": str(tmp_path / "disk"), "capacity": "16 blocks"}]}
    return tiers


def _spec(tmp_path, engine_id, direct=None, world_size=1):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    config = _config(tmp_path, events=True, kvtier_config=_tiers(tmp_path), engine_id=engine_id,
                     world_size=world_size)
    if direct is not None:
        config.extra_config["direct_file_loads"] = direct
    return KVTierOffloadingSpec(config)


def _caches():
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    engine = torch.randint(-128, 127, (ENGINE_BLOCKS, PAGE), dtype=torch.int8)
    return engine, CanonicalKVCaches([CanonicalKVCacheTensor(engine, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])


def _adopt(manager):
    """What `KVTierOffloadingConnector` does when it takes over `manager`: kvtier's manager may then
    load file tiers directly (failed loads are recomputed)."""
    if manager.direct_file_loads is not None:
        manager.direct_file_loads.enable()


def _gpu(first: int, n_keys: int):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    n = n_keys * BPC
    return GPULoadStoreSpec(list(range(first, first + n)), group_sizes=[n], block_indices=[0])


class Engine:
    """A scheduler-side manager and a worker over CPU tensors, as vLLM's "uni" executor builds
    them: two specs of one engine in one process, the worker's first (it registers the KV caches
    before the scheduler exists). `direct` is the `direct_file_loads` option (None: unset); left
    out, it is unset where that turns direct loads on (vLLM 0.32), `true` where they must be asked
    for (0.33: `test_on_a_vllm_with_sync_loads_direct_file_loads_must_be_asked_for`)."""

    def __init__(self, tmp_path, direct="where needed", connector=True, local=True, world_size=1):
        from kvtier.integrations.vllm.spec import vllm_has_sync_loads

        if direct == "where needed":
            direct = True if vllm_has_sync_loads() else None
        engine_id = f"direct-{time.time_ns()}"
        self.kv, caches = _caches()
        self.worker_spec = _spec(tmp_path, engine_id, direct, world_size)
        self.worker = self.worker_spec.get_worker(caches) if local else None
        self.spec = _spec(tmp_path, engine_id, direct, world_size)
        self.manager = self.spec.get_manager()
        if local is False:  # the worker lives in another process: built after the scheduler here
            self.worker = self.worker_spec.get_worker(caches)
        if connector:
            _adopt(self.manager)
        self.stored: dict[bytes, object] = {}

    def store(self, keys, first: int, ctx):
        """Store `keys` from engine blocks `first`... (their bytes recorded), written through."""
        out = self.manager.prepare_store(keys, ctx)
        assert self.worker.submit_store(1, _gpu(first, len(keys)), out.store_spec)
        self.worker.wait({1})
        assert all(r.success for r in self.worker.get_finished())
        self.manager.complete_store(keys, ctx)
        _settle(self.manager)
        for i, key in enumerate(keys):
            self.stored[key] = self.kv[first + i * BPC:first + (i + 1) * BPC].clone()

    def load(self, keys, first: int, ctx, job_id=2):
        spec = self.manager.prepare_load(keys, ctx)
        assert self.worker.submit_load(job_id, spec, _gpu(first, len(keys)))
        self.worker.wait({job_id})
        (result,) = self.worker.get_finished()
        return spec, result

    def loaded_equal(self, keys, first: int) -> bool:
        import torch

        return all(torch.equal(self.kv[first + i * BPC:first + (i + 1) * BPC], self.stored[k])
                   for i, k in enumerate(keys))

    def file_tier(self):
        return self.manager.hierarchy.manager.tiers[1]

    def close(self):
        self.worker.shutdown()
        self.manager.shutdown()


@pytest.fixture
def make(tmp_path):
    made = []

    def build(**kwargs):
        engine = Engine(tmp_path, **kwargs)
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.close()


def _pushed_out(engine, ctx):
    """Two blocks stored, then pushed out of the 4-block CPU tier by four more: only in the file tier."""
    from vllm.v1.kv_offload.base import LookupResult

    keys = _keys(2)
    engine.store(keys, 0, ctx)
    engine.store(_keys(4, start=10), 4, ctx)
    assert engine.manager.hierarchy.manager.tiers[0].readable(keys[0]) is None
    assert engine.file_tier().readable(keys[0]) is not None
    assert engine.manager.lookup(keys[1], ctx) in (LookupResult.HIT, LookupResult.RETRY)
    return keys


def test_a_file_only_block_is_a_hit_loaded_by_the_worker_straight_from_the_file_tier(make):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm.translate import KVTierFileLoadStoreSpec

    engine, ctx = make(), ReqContext("r")
    keys = _pushed_out(engine, ctx)
    assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 2  # no RETRY
    assert engine.manager.get_load_source(keys[0], ctx).value == "disk"
    engine.kv.zero_()
    spec, result = engine.load(keys, 8, ctx)
    assert isinstance(spec, KVTierFileLoadStoreSpec) and spec.tier == "disk"
    assert result.success and result.transfer_size == 2 * BPC * PAGE
    assert engine.loaded_equal(keys, 8)
    tier = engine.file_tier()
    assert all(tier.policy.get(k).ref_cnt == 1 for k in keys)  # pinned in the file tier while loading
    engine.manager.complete_load(keys, ctx)
    assert all(tier.policy.get(k).ref_cnt == 0 for k in keys)  # released
    stats = engine.manager.tier_stats()
    assert stats["disk"]["hits"] == 2 and stats["disk"]["promotions"] == 0
    assert stats["cpu"]["hits"] == 0


def test_a_request_split_between_the_cpu_and_file_tiers_is_one_composite_load(make):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm.translate import KVTierCompositeLoadStoreSpec

    engine, ctx = make(), ReqContext("r")
    old = _pushed_out(engine, ctx)
    recent = _keys(2, start=12)  # still in the CPU tier (and in the file tier)
    keys = [recent[0], old[0], recent[1], old[1]]
    assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
    engine.kv.zero_()
    spec, result = engine.load(keys, 8, ctx)
    assert isinstance(spec, KVTierCompositeLoadStoreSpec)
    assert sorted((type(part).__name__, positions) for part, positions in spec.parts) == [
        ("KVTierCPULoadStoreSpec", [0, 2]), ("KVTierFileLoadStoreSpec", [1, 3])]
    assert result.success and engine.loaded_equal(keys, 8)
    engine.manager.complete_load(keys, ctx)
    stats = engine.manager.tier_stats()
    assert (stats["cpu"]["hits"], stats["disk"]["hits"], stats["disk"]["promotions"]) == (2, 2, 0)


def _corrupt(engine, key) -> None:
    """Flip one payload byte of `key`'s slot on disk."""
    from kvtier.tiers.file.slot_format import HEADER_BYTES

    backend = engine.file_tier().backend
    slot = engine.file_tier().policy.get(key).block_id
    with open(backend.slab_path, "r+b") as f:
        f.seek(slot * backend.slot_bytes + HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(slot * backend.slot_bytes + HEADER_BYTES + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("composite", [False, True])
def test_a_corrupted_file_block_fails_alone_and_only_it_is_dropped(make, composite):
    """Issue 42, item 3: the load fails naming the bad block (the worker's `take_failure`); the
    blocks before it are loaded, its engine pages untouched; the scheduler side drops it alone
    from the file tier, counted once; the load's other blocks stay HITs."""
    import torch
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    engine, ctx = make(), ReqContext("r")
    old = _pushed_out(engine, ctx)
    keys = [_keys(1, start=12)[0], *old] if composite else old
    _corrupt(engine, old[1])
    free = engine.file_tier().backend.get_num_free_blocks()
    failures = {name: row["failures"] for name, row in engine.manager.hierarchy.manager.get_stats().items()}
    engine.kv.zero_()
    _, result = engine.load(keys, 8, ctx)
    assert not result.success
    bad_at = keys.index(old[1])
    assert engine.worker.take_failure(2) == ([bytes(old[1])], bad_at)
    assert engine.loaded_equal(keys[:bad_at], 8)  # the blocks before the bad one were loaded
    assert not engine.kv[8 + bad_at * BPC:8 + (bad_at + 1) * BPC].any()  # the bad one's pages untouched
    engine.manager.complete_failed_load(keys, ctx, [old[1]])  # what KVTierOffloadingConnector does with it
    after = {name: row["failures"] for name, row in engine.manager.hierarchy.manager.get_stats().items()}
    assert after == {"cpu": failures["cpu"], "disk": failures["disk"] + 1}  # the bad block, once
    assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * bad_at + [LookupResult.MISS]
    assert engine.file_tier().backend.get_num_free_blocks() == free + 1
    removed = {(e.medium.name, k) for e in engine.manager.take_events() if e.removed for k in e.keys}
    assert ("STORAGE", old[1]) in removed and ("STORAGE", old[0]) not in removed
    # the engine goes on: a block stored now loads fine
    later = _keys(1, start=30)
    engine.store(later, 0, ctx)
    engine.kv[8:8 + BPC].zero_()
    _, result = engine.load(later, 8, ctx, job_id=3)
    assert result.success and torch.equal(engine.kv[8:8 + BPC], engine.stored[later[0]])


@pytest.mark.parametrize("case", ["worker_elsewhere", "tensor_parallel"])
def test_a_worker_in_another_process_or_tp_loads_file_blocks_directly_too(make, case, caplog):
    """Issue 38: the two cases that used to fall back to promotion. The spec handed out names the
    file tier's slots, keys and manifest digest (no path); the worker finds the tier in its own
    config (test_vllm_tp.py runs real rank processes)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm.translate import KVTierFileLoadStoreSpec

    caplog.set_level("INFO", logger="kvtier")
    engine = make(**{"worker_elsewhere": {"local": False}, "tensor_parallel": {"world_size": 2}}[case])
    ctx = ReqContext("r")
    assert engine.manager.direct_file_loads.enabled
    keys = _keys(2)
    engine.manager.complete_store(engine.manager.prepare_store(keys, ctx).keys_to_store, ctx)
    _settle(engine.manager)
    engine.manager.complete_store(engine.manager.prepare_store(_keys(4, start=10), ctx).keys_to_store, ctx)
    _settle(engine.manager)
    assert engine.manager.lookup(keys[0], ctx) is LookupResult.HIT
    spec = engine.manager.prepare_load(keys, ctx)
    assert isinstance(spec, KVTierFileLoadStoreSpec) and spec.identity == engine.file_tier().backend.digest
    assert not hasattr(spec, "root_dir") and "disk" not in repr(vars(spec).get("keys"))
    engine.manager.complete_load(keys, ctx)
    each = "each of the 2 tensor-parallel ranks" if case == "tensor_parallel" else "the worker"
    assert f"loaded by the worker directly and verified there ({each} opens them read-only" in caplog.text


@pytest.mark.parametrize("case", ["vllm_connector", "option_off"])
def test_otherwise_a_file_only_block_is_promoted_through_the_cpu_tier(make, case, caplog):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm.translate import KVTierCPULoadStoreSpec

    kwargs = {"vllm_connector": {"connector": False}, "option_off": {"direct": False}}[case]
    caplog.set_level("INFO", logger="kvtier")
    engine, ctx = make(**kwargs), ReqContext("r")
    engine.manager.on_new_request(ctx)  # (as vLLM's scheduler does before it looks a request up)
    assert not engine.manager.direct_file_loads.enabled
    keys = _pushed_out(engine, ctx)
    assert engine.manager.lookup(keys[0], ctx) is LookupResult.RETRY  # promoted, verified on the scheduler side
    _settle(engine.manager)
    assert engine.manager.lookup(keys[0], ctx) is LookupResult.HIT
    assert isinstance(engine.manager.prepare_load(keys[:1], ctx), KVTierCPULoadStoreSpec)
    assert engine.manager.tier_stats()["disk"]["promotions"] >= 1
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "promoted into the CPU tier" in logged and "loaded by the worker directly" not in logged


@pytest.mark.parametrize("case", ["kvtier_connector", "vllm_connector", "option_off"])
def test_one_log_line_says_which_path_the_file_tiers_take(make, caplog, case):
    """Issue 36.10: under KVTierOffloadingConnector the engine logged 'promoted into the CPU tier
    ..., unless the connector reports failed loads' and then 'loaded by the worker directly': two
    lines that read as contradictory where docs/vllm.md promises one. Now the one line comes once
    the path is known: at start-up where the connector or an option decides it, at the engine's
    first request under vLLM's own connector (it never says anything)."""
    from vllm.v1.kv_offload.base import ReqContext

    caplog.set_level("INFO", logger="kvtier")
    kwargs = {"kvtier_connector": {}, "vllm_connector": {"connector": False}, "option_off": {"direct": False}}[case]
    engine = make(**kwargs)
    for request in ("r1", "r2"):
        engine.manager.on_new_request(ReqContext(request))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier: file tier(s) disk: ")]
    expected = {"kvtier_connector": "disk: loaded by the worker directly and verified there",
                "vllm_connector": "disk: promoted into the CPU tier and verified there (the connector does not "
                                  "report failed loads",
                "option_off": "disk: promoted into the CPU tier and verified there (direct_file_loads: false)"}[case]
    assert len(lines) == 1 and expected in lines[0], lines


@pytest.mark.parametrize("value", ["yes", 1, "", [True]])
def test_a_bad_direct_file_loads_value_is_a_config_error(tmp_path, value):
    from kvtier.core.errors import ConfigError

    with pytest.raises(ConfigError, match="direct_file_loads: must be true or false"):
        _spec(tmp_path, f"bad-{time.time_ns()}", direct=value)


@pytest.mark.parametrize("value", ["false", "False", False])
def test_direct_file_loads_false_accepts_a_bool_or_its_name(make, value):
    engine = make(direct=value)
    assert engine.manager.direct_file_loads.reason == "direct_file_loads: false"


def test_a_direct_file_load_flushed_by_a_reset_releases_its_file_tier_pin(make):
    """vLLM 0.33: a load in flight at a cache reset is never completed; `on_reset_flushed`
    releases it. Its pin in the file tier must go too, or the block could never be evicted."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    engine, ctx = make(), ReqContext("r")
    keys = _pushed_out(engine, ctx)
    engine.manager.prepare_load(keys, ctx)
    engine.manager.reset_cache()
    assert engine.manager.lookup(keys[0], ctx) is LookupResult.HIT  # still pinned: a worker may read it
    engine.manager.on_reset_flushed()
    assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2
    # a flushed load did not fail: no tier counts a failure
    assert {row["failures"] for row in engine.manager.hierarchy.manager.get_stats().values()} == {0}
    assert engine.file_tier().backend.get_num_free_blocks() == engine.file_tier().capacity
    with pytest.raises(KeyError):  # no pin is left to release
        engine.manager.hierarchy.manager.complete_load(keys)


def test_a_worker_that_cannot_open_the_file_tier_fails_such_a_load_and_says_why(make, caplog):
    """The worker opens the file tier itself at its first file load, with the tier's own checks: a
    root_dir that became group-writable is refused (the scheduler, which opened it before, serves
    on). The load fails (the KV cache untouched: vLLM recomputes), the reason is logged once, and
    the next file load opens the tier again once it is safe."""
    import os

    from vllm.v1.kv_offload.base import ReqContext

    engine, ctx = make(), ReqContext("r")
    keys = _pushed_out(engine, ctx)
    root = engine.file_tier().backend.root
    os.chmod(root, 0o770)
    caplog.set_level("ERROR", logger="kvtier")
    engine.kv.zero_()
    for job_id in (2, 3):
        spec = engine.manager.prepare_load(keys, ctx)
        assert engine.worker.submit_load(job_id, spec, _gpu(8, 2))
        engine.worker.wait({job_id})
        (result,) = engine.worker.get_finished()
        assert not result.success and not engine.kv.any()
        engine.manager.complete_failed_load(keys, ctx, [])  # (nothing named bad: the blocks stay)
    refusals = [r.getMessage() for r in caplog.records if "cannot read the file tier(s) directly" in r.getMessage()]
    assert len(refusals) == 1 and "writable by group or others" in refusals[0], refusals
    os.chmod(root, 0o700)
    _, result = engine.load(keys, 8, ctx, job_id=4)
    assert result.success and engine.loaded_equal(keys, 8)
    engine.manager.complete_load(keys, ctx)


def test_a_load_naming_another_tier_identity_fails_untouched(make, caplog):
    """The spec carries the scheduler's manifest digest (epoch included): a worker whose reader
    opened another tier (a rebuilt one, another root_dir) fails the load instead of reading it."""
    from vllm.v1.kv_offload.base import ReqContext

    engine, ctx = make(), ReqContext("r")
    keys = _pushed_out(engine, ctx)
    _, result = engine.load(keys, 8, ctx)  # (opens the readers)
    assert result.success
    engine.manager.complete_load(keys, ctx)
    spec = engine.manager.prepare_load(keys, ctx)
    spec.identity = bytes(8)
    engine.kv.zero_()
    assert engine.worker.submit_load(3, spec, _gpu(8, 2))
    engine.worker.wait({3})
    (result,) = engine.worker.get_finished()
    assert not result.success and not engine.kv.any()
    assert "direct file load job 3 failed: KVTierError: file tier disk: a load names tier identity 0000" in caplog.text
    engine.manager.complete_load(keys, ctx)


@pytest.mark.parametrize("option", [None, True])
def test_on_a_vllm_with_sync_loads_direct_file_loads_must_be_asked_for(make, monkeypatch, option, caplog):
    """vLLM 0.33's synchronous loads: a failed one may be recomputed wrongly (vLLM bug #49250),
    so there file tiers are promoted unless `direct_file_loads: true` says otherwise (with a warning)."""
    from kvtier.integrations.vllm import spec as spec_module

    monkeypatch.setattr(spec_module, "vllm_has_sync_loads", lambda: True)
    caplog.set_level("INFO", logger="kvtier")
    engine = make(direct=option)
    assert engine.manager.direct_file_loads.enabled is bool(option)
    if option:
        assert "vLLM bug #49250" in caplog.text and engine.file_tier().direct_load
    else:
        assert "#49250" in engine.manager.direct_file_loads.reason and not engine.file_tier().direct_load


def test_this_vllm_032_has_no_sync_loads_so_direct_file_loads_are_on_by_default(make):
    from kvtier.integrations.vllm.spec import vllm_has_sync_loads

    if vllm_has_sync_loads():
        pytest.skip("this vLLM has synchronous loads (0.33+)")
    assert make().manager.direct_file_loads.enabled


def test_a_direct_file_load_is_scattered_on_the_thread_that_collects_it(make, monkeypatch):
    """The read and verification run on the file loads' threads; the scatter into the KV cache
    runs where the engine collects the job (`get_finished` / `wait`), not on a pool thread."""
    import threading

    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.transfer.handlers.gpu_file import GPUFileHandler

    engine, ctx = make(), ReqContext("r")
    keys = _pushed_out(engine, ctx)
    threads = {}
    for name in ("stage_load", "finish_load"):
        real = getattr(GPUFileHandler, name)

        def record(self, *args, _real=real, _name=name):
            threads[_name] = threading.get_ident()
            return _real(self, *args)

        monkeypatch.setattr(GPUFileHandler, name, record)
    _, result = engine.load(keys, 8, ctx)
    assert result.success and engine.loaded_equal(keys, 8)
    assert threads["finish_load"] == threading.get_ident() != threads["stage_load"]


def test_waiting_for_the_file_loads_returns_once_one_was_read(make):
    """`wait_for_file_loads` (an idle engine step): it returns once the direct load in flight has
    been read, so the same step's `get_finished` reports it, the bytes in the KV cache; with none
    in flight it returns at once."""
    import time

    from vllm.v1.kv_offload.base import ReqContext

    engine, ctx = make(), ReqContext("r")
    keys = _pushed_out(engine, ctx)
    started = time.perf_counter()
    engine.worker.wait_for_file_loads(30.0)  # (no file load yet: nothing to wait for)
    assert time.perf_counter() - started < 1.0
    engine.kv.zero_()
    assert engine.worker.submit_load(2, engine.manager.prepare_load(keys, ctx), _gpu(8, 2))
    engine.worker.wait_for_file_loads(30.0)
    (result,) = engine.worker.get_finished()
    assert result.success and engine.loaded_equal(keys, 8)
    engine.manager.complete_load(keys, ctx)


def test_a_slot_pinned_by_a_load_is_not_reused_while_the_worker_reads_it(make):
    """The scheduler keeps each file block of a load pinned until `complete_load`: stores that
    churn the whole file tier meanwhile evict other blocks, never reallocate or rewrite the
    pinned slots, so the worker's read (after the churn) still gets the load's bytes."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    engine, ctx = make(), ReqContext("r")
    keys = _pushed_out(engine, ctx)
    tier = engine.file_tier()
    slots = [tier.policy.get(k).block_id for k in keys]
    spec = engine.manager.prepare_load(keys, ctx)
    evicted_before = tier.stats.evictions
    for start in range(100, 100 + 5 * 4, 4):  # 20 new blocks written through a 16-block file tier
        engine.store(_keys(4, start=start), 4, ctx)
    assert tier.stats.evictions - evicted_before >= 20 - (tier.capacity - len(keys) - 4)
    assert [tier.policy.get(k).block_id for k in keys] == slots and all(tier.policy.get(k).ref_cnt == 1 for k in keys)
    engine.kv.zero_()
    assert engine.worker.submit_load(2, spec, _gpu(8, 2))
    engine.worker.wait({2})
    (result,) = engine.worker.get_finished()
    assert result.success and engine.loaded_equal(keys, 8)
    engine.manager.complete_load(keys, ctx)
    for start in range(200, 200 + 5 * 4, 4):  # unpinned, they go like any other
        engine.store(_keys(4, start=start), 4, ctx)
    assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2
