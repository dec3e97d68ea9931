"""`shared: host` under vLLM without an engine: kvtier's spec, manager and worker over a real owner.

Two specs of one identity (engines A and B) join one `kvtier serve` subprocess: what A's worker
stores, B's manager finds and B's worker loads, byte-identical, from the owner's region. Another
identity misses. A killed owner turns lookups into misses within `timeout_ms` and stores into
`None`, with no exception; a restarted one serves the file tier again (RETRY while it promotes,
then HIT, from its new region). A load the owner only partly pins fails exactly the positions it
did not pin, and the pinned ones are loaded.
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
from host_owner import Owner  # noqa: E402

PAGE = 1024  # bytes per engine block of the one KV tensor
BPC = 2  # engine blocks per offloaded block
TIMEOUT_MS = 200


def _config(kvtier_config, model="tiny", rank=0, world=1, extra=None):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=False,
        extra_config={"kvtier_config": kvtier_config, **(extra or {})}, engine_id=f"host-{time.time_ns()}",
        model=OffloadingModelConfig(name=model, dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC),
        parallel=OffloadingParallelConfig(rank=rank, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def _keys(n, start=0):
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


class Engine:
    """One engine's scheduler side (manager) and worker over 16 engine blocks of random bytes."""

    def __init__(self, kvtier_config, model="tiny", world=1, extra=None):
        """`world` > 1: tensor parallel; `ranks[r]` = (spec, KV tensor, worker) of rank r (rank 0's are
        `spec`, `kv`, `worker`); jobs run on every rank."""
        import torch
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

        from kvtier.integrations.vllm import KVTierOffloadingSpec

        self.ranks = []
        for rank in range(world):
            spec = KVTierOffloadingSpec(_config(kvtier_config, model, rank, world, extra))
            kv = torch.randint(-128, 127, (16, PAGE), dtype=torch.int8)
            caches = CanonicalKVCaches([CanonicalKVCacheTensor(kv, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])
            self.ranks.append((spec, kv, spec.get_worker(caches)))
        self.spec, self.kv, self.worker = self.ranks[0]
        self.manager = self.spec.get_manager()
        self.jobs = 0

    def lookup(self, key):
        from vllm.v1.kv_offload.base import ReqContext

        self.manager.on_schedule_end(None)  # (a new scheduler step: lookups are remembered within one)
        return self.manager.lookup(key, ReqContext("r"))

    def run(self, submit, *args):
        """Run one transfer job to its end on every rank (`submit`: the worker's method name); rank 0's result."""
        self.jobs += 1
        results = []
        for _, _, worker in self.ranks:
            assert getattr(worker, submit)(self.jobs, *args)
            worker.wait({self.jobs})
            (result,) = worker.get_finished()
            assert result.job_id == self.jobs
            results.append(result)
        assert len({r.success for r in results}) == 1
        return results[0]

    def store(self, keys, blocks):
        from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext

        out = self.manager.prepare_store(keys, ReqContext("r"))
        assert out is not None and out.keys_to_store == keys
        result = self.run("submit_store", GPULoadStoreSpec(blocks, group_sizes=[len(blocks)],
                                                                     block_indices=[0]), out.store_spec)
        self.manager.complete_store(keys, ReqContext("r"), success=result.success)
        return result

    def load(self, keys, gpu):
        from vllm.v1.kv_offload.base import ReqContext

        spec = self.manager.prepare_load(keys, ReqContext("r"))
        return spec, self.run("submit_load", spec, gpu)

    def close(self):
        for spec, _, _ in reversed(self.ranks):
            spec.shutdown()


def _tiers(owner, cpu_blocks=4, disk=True):
    cpu = {"name": "cpu", "backend": "cpu", "capacity": f"{cpu_blocks} blocks", "policy": "lru"}
    tiers = [cpu]
    if disk:
        cpu["cascade"] = "on_store"
        tiers.append({"name": "disk", "backend": "file", "root_dir": f"{owner.dir}/disk", "capacity": "16 blocks"})
    return {"shared": owner.shared(TIMEOUT_MS), "tiers": tiers}


@pytest.fixture(scope="module")
def owner():
    """One owner for the module's tests (each test's engines are of a model of its own)."""
    o = Owner().start()
    yield o
    o.close()


@pytest.fixture
def own_owner():
    """An owner for one test (that kills it)."""
    o = Owner().start()
    yield o
    o.close()


@pytest.fixture
def engines(request):
    """Engines of this test's own model identity (another test's blocks are another namespace's)."""
    made = []

    def make(*args, model=None, **kwargs):
        made.append(Engine(*args, model=model or f"tiny-{request.node.name}", **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _gpu(blocks, first_index=0):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[first_index])


def test_engine_b_loads_what_engine_a_stored(owner, engines):
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm import KVTierHostLoadStoreSpec

    a, b = engines(_tiers(owner)), engines(_tiers(owner))
    keys = _keys(3)
    assert b.lookup(keys[0]) is LookupResult.MISS
    assert a.store(keys, list(range(6))).success
    assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 3
    b.kv.zero_()
    # logical blocks 1..5 of a request: the first offloaded block only half covered
    spec, result = b.load(keys, _gpu([9, 10, 11, 12, 13], first_index=1))
    assert isinstance(spec, KVTierHostLoadStoreSpec) and spec.pinned == 3 and spec.shm_name.startswith("kvtier-host-")
    assert result.success and result.transfer_size == 5 * PAGE
    b.manager.complete_load(keys, None)
    import torch

    for engine_block, stored in zip([9, 10, 11, 12, 13], [1, 2, 3, 4, 5]):
        assert torch.equal(b.kv[engine_block], a.kv[stored])
    assert not b.kv[:9].any()
    stats = b.manager.tier_stats()
    assert stats["engine"]["loaded"] == 3 and stats["cpu"]["resident_blocks"] == 3
    assert a.manager.tier_stats()["engine"]["stored"] == 3


def _counting_calls(manager):
    """Count `manager`'s calls to its owner, by operation."""
    from collections import Counter

    calls, call = Counter(), manager.client.call

    def counted(op, **arguments):
        calls[op] += 1
        return call(op, **arguments)

    manager.client.call = counted
    return calls


def _scan(manager, context, keys):
    """vLLM's prefix scan (`_maximal_prefix_lookup`): one lookup per key, up to the first MISS."""
    from vllm.v1.kv_offload.base import LookupResult

    answers = []
    for key in keys:
        answers.append(manager.lookup(key, context))
        if answers[-1] is LookupResult.MISS:
            break
    return answers


def test_a_prefix_scan_costs_one_owner_call(owner, engines):
    """vLLM looks a request's keys up one by one; the first lookup asks the owner about the keys
    the scheduler recorded after it, so the scan of a 6-block hit costs one round trip, not 7."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a, b = engines(_tiers(owner, cpu_blocks=8, disk=False)), engines(_tiers(owner, cpu_blocks=8, disk=False))
    keys = _keys(8, start=500)
    assert a.store(keys[:6], list(range(12))).success
    context = ReqContext("scan")
    for position, key in enumerate(keys, start=1):
        context.set_offload_key_position(key, position * 16 * BPC)
    calls = _counting_calls(b.manager)
    b.manager.on_schedule_end(None)
    assert _scan(b.manager, context, keys) == [LookupResult.HIT] * 6 + [LookupResult.MISS]
    assert calls["lookup_run"] == 1
    # the next step asks again (another engine may have evicted since): one call again
    b.manager.on_schedule_end(None)
    assert _scan(b.manager, context, keys) == [LookupResult.HIT] * 6 + [LookupResult.MISS]
    assert calls["lookup_run"] == 2


def test_a_scan_ends_at_its_group_and_without_positions_asks_key_by_key(owner, engines):
    """The keys after a lookup's key are its own group's (positions rise); another group's recorded
    after them start a run of their own; a context with no positions asks one key at a time."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a, b = engines(_tiers(owner, cpu_blocks=8, disk=False)), engines(_tiers(owner, cpu_blocks=8, disk=False))
    first, second = _keys(3, start=600), _keys(3, start=700)
    assert a.store(first + second[:1], list(range(8))).success
    context = ReqContext("groups")
    for group in (first, second):
        for position, key in enumerate(group, start=1):
            context.set_offload_key_position(key, position * 16 * BPC)
    calls = _counting_calls(b.manager)
    b.manager.on_schedule_end(None)
    assert _scan(b.manager, context, first) == [LookupResult.HIT] * 3
    assert calls["lookup_run"] == 1
    assert _scan(b.manager, context, second) == [LookupResult.HIT, LookupResult.MISS]
    assert calls["lookup_run"] == 2
    b.manager.on_schedule_end(None)
    assert _scan(b.manager, ReqContext("no positions"), first) == [LookupResult.HIT] * 3
    assert calls["lookup_run"] == 5


def test_another_identity_never_sees_the_blocks(owner, engines):
    from vllm.v1.kv_offload.base import LookupResult

    a, other = engines(_tiers(owner)), engines(_tiers(owner), model="another-model")
    keys = _keys(2)
    assert a.store(keys, list(range(4))).success
    assert a.lookup(keys[0]) is LookupResult.HIT
    assert other.lookup(keys[0]) is LookupResult.MISS
    assert other.manager.client.region["shm_name"] != a.manager.client.region["shm_name"]


def test_other_tiers_for_the_same_model_are_refused_at_start(owner, engines):
    from kvtier.host.client import HostRefused

    engines(_tiers(owner))
    with pytest.raises(HostRefused, match="same tiers"):
        engines(_tiers(owner, cpu_blocks=8))


def _wait_for(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_killed_owner_is_a_miss_and_a_restarted_one_serves_the_file_tier(own_owner, engines):
    owner = own_owner
    import torch
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a, b = engines(_tiers(owner)), engines(_tiers(owner))
    keys = _keys(2)
    assert a.store(keys, [0, 1, 2, 3]).success
    _wait_for(lambda: a.manager.tier_stats().get("disk", {}).get("stores", 0) >= 2)  # written through
    old_region = b.manager.client.region["token"]

    owner.kill()
    start = time.monotonic()
    assert b.lookup(keys[0]) is LookupResult.MISS
    assert time.monotonic() - start < TIMEOUT_MS / 1000 + 0.5
    start = time.monotonic()
    assert b.lookup(keys[1]) is LookupResult.MISS  # (at once: the client stays away for its backoff)
    unavailable = b.manager.counters["unavailable"]
    assert b.manager.lookup(keys[1], ReqContext("r")) is LookupResult.MISS  # (the same step: remembered)
    assert b.manager.counters["unavailable"] == unavailable
    assert b.manager.prepare_store(_keys(1, start=50), ReqContext("r")) is None
    assert time.monotonic() - start < 0.1
    spec, result = b.load(keys, _gpu([8, 9, 10, 11]))  # pins nothing: every position fails
    assert spec.pinned == 0 and not result.success
    assert b.worker.take_failure(result.job_id) == (keys, 0)
    b.manager.complete_failed_load(keys, None, keys)  # no exception, nothing sent
    b.manager.complete_store(_keys(1, start=50), None, success=True)

    owner.start()
    answers = []
    _wait_for(lambda: answers.append(b.lookup(keys[0])) or answers[-1] is LookupResult.HIT)
    assert LookupResult.RETRY in answers  # promoted from the recovered file tier first
    _wait_for(lambda: b.lookup(keys[1]) is LookupResult.HIT)
    b.kv.zero_()
    spec, result = b.load(keys, _gpu([8, 9, 10, 11]))
    assert spec.region != old_region and spec.pinned == 2 and result.success  # the new owner's region
    b.manager.complete_load(keys, None)
    assert torch.equal(b.kv[8:12], a.kv[0:4])


def test_a_load_the_owner_partly_pins_fails_exactly_the_unpinned_positions(owner, engines):
    import torch
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a, b = engines(_tiers(owner, disk=False)), engines(_tiers(owner, disk=False))
    keys = _keys(4)
    assert a.store(keys, list(range(8))).success  # the CPU tier (4 blocks) is full
    assert [b.lookup(k) for k in keys] == [LookupResult.HIT] * 4
    a.manager.touch(keys[:2], ReqContext("r"))  # keys 2 and 3 are now the least recently used
    assert a.store(_keys(2, start=10), [8, 9, 10, 11]).success  # ...and evicted by engine A's store
    b.kv.zero_()
    spec, result = b.load(keys, _gpu([1, 2, 3, 4, 5, 6, 7], first_index=1))
    assert spec.pinned == 2 and not result.success
    bad, first = b.worker.take_failure(result.job_id)
    assert bad == keys[2:] and first == 2
    assert torch.equal(b.kv[1:4], a.kv[1:4])  # the pinned keys' engine blocks were loaded
    assert not b.kv[4:8].any()  # the others were not touched
    b.manager.complete_failed_load(keys, None, bad)
    assert b.lookup(keys[0]) is LookupResult.HIT  # unpinned and kept: they were not the failed ones
    assert b.lookup(keys[2]) is LookupResult.MISS
    assert b.manager.tier_stats()["engine"]["short"] == 2


@pytest.mark.parametrize("where", ["yaml", "extra_config"])
def test_the_owner_applies_the_store_threshold_to_every_engines_offers(owner, engines, where):
    """`store_threshold: 2` (in the YAML, or vLLM's `kv_connector_extra_config`) counts offers
    host-wide: A's first offer is skipped (vLLM's `stores_skipped`), B's offer of the same keys is
    their second and is stored."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm.vllm_metrics import STORES_SKIPPED

    if where == "yaml":
        a, b = (engines({**_tiers(owner), "store_threshold": 2}) for _ in range(2))
    else:
        a, b = (engines(_tiers(owner), extra={"store_threshold": 2}) for _ in range(2))
    keys = _keys(2, start=800)
    a.manager.get_stats()  # (baseline)
    out = a.manager.prepare_store(keys, ReqContext("r"))
    assert out is not None and out.keys_to_store == []
    assert a.manager.get_stats().data["data"][STORES_SKIPPED] == {(): 2}
    assert b.store(keys, [0, 1, 2, 3]).success
    assert a.lookup(keys[1]) is LookupResult.HIT


def test_blocks_a_request_offers_again_are_touched_when_it_ends(owner, engines):
    """vLLM 0.32's recency per request, in shared mode: the blocks a request offers to
    `prepare_store` that the owner holds become the most recent when the request finishes, so
    the next eviction takes another."""
    from vllm.v1.kv_offload.base import ReqContext

    a, b = (engines(_tiers(owner, cpu_blocks=4, disk=False)) for _ in range(2))
    keys = _keys(4, start=900)
    for i, key in enumerate(keys):  # (oldest first: the LRU tier's first victim is keys[0])
        assert a.store([key], [2 * i, 2 * i + 1]).success
    context = ReqContext("again")
    again = b.manager.prepare_store(keys[:1], context)  # (held: nothing to store)
    assert again is not None and again.keys_to_store == []
    b.manager.on_request_finished(context)
    out = a.manager.prepare_store(_keys(1, start=960), ReqContext("new"))
    assert out is not None and out.evicted_keys == [keys[1]]


def test_stats_config_info_and_the_lock(owner, engines):
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.integrations.vllm import KVTierOffloadingSpec
    from kvtier.integrations.vllm.manager import CONFIG_INFO_KEYS

    a, b = engines(_tiers(owner)), engines(_tiers(owner))
    keys = _keys(2)
    assert a.store(keys, [0, 1, 2, 3]).success
    spec, result = b.load(keys, _gpu([4, 5, 6, 7]))
    assert result.success
    b.manager.complete_load(keys, ReqContext("r"))
    stats = b.manager.get_stats().data["data"]
    assert set(stats) <= set(KVTierOffloadingSpec.build_metric_definitions({}))
    assert stats["vllm:kvtier_hits"][("cpu",)] == 2
    assert stats["vllm:kvtier_capacity_blocks"][("cpu",)] == 4  # the owner's, shared by both engines
    assert "vllm:kvtier_hits" not in b.manager.get_stats().data["data"]  # counters are deltas
    info = b.manager.config_info()
    assert [i["tier"] for i in info] == ["cpu", "disk"] and set(info[0]) == set(CONFIG_INFO_KEYS)
    assert info[0]["kvtier_capacity_blocks"] == 4 and "shared: host" in info[0]["kvtier_config"]
    with b.manager.lock, b.manager.lock:  # vLLM 0.33: a real, re-entrant lock
        pass
    assert list(b.manager.take_events()) == []


def test_a_reset_releases_the_pins_in_flight_once_flushed(owner, engines):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a, b = engines(_tiers(owner, disk=False)), engines(_tiers(owner, disk=False))
    keys = _keys(4)
    assert a.store(keys, list(range(8))).success
    b.manager.prepare_load(keys[:1], ReqContext("r"))  # a load in flight when the engine resets
    b.manager.reset_cache()
    b.manager.on_reset_flushed()  # vLLM 0.33: its workers are done with it: the pin goes
    assert a.store(_keys(4, start=10), list(range(8))).success  # room for 4: every old block evicted
    assert b.lookup(keys[0]) is LookupResult.MISS


def test_without_on_reset_flushed_the_transfers_in_flight_are_released_after_the_grace(owner, engines,
                                                                                         monkeypatch):
    """vLLM 0.32 never calls `on_reset_flushed`: the pins and stores in flight at a reset are
    released at the first step `FLUSHED_RELEASE_S` after it (not before: a worker may copy)."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.integrations.vllm import host_manager

    monkeypatch.setattr(host_manager, "FLUSHED_RELEASE_S", 0.3)
    a, b = engines(_tiers(owner, disk=False)), engines(_tiers(owner, disk=False))
    keys = _keys(3, start=40)
    assert a.store(keys, list(range(6))).success
    b.manager.prepare_load(keys, ReqContext("r"))  # a load in flight when the engine resets
    assert b.manager.prepare_store(_keys(1, start=50), ReqContext("r")) is not None  # and a store
    b.manager.reset_cache()
    b.manager.on_schedule_end(None)  # (within the grace: still held)
    assert a.manager.prepare_store(_keys(2, start=60), ReqContext("x")) is None  # 3 pinned + 1 being written
    time.sleep(0.35)
    b.manager.on_schedule_end(None)
    out = a.manager.prepare_store(_keys(4, start=60), ReqContext("x"))
    assert out is not None and len(out.keys_to_store) == 4


def test_under_tensor_parallelism_each_rank_copies_its_part_of_the_slot(owner, engines):
    import torch

    a, b = engines(_tiers(owner), world=2), engines(_tiers(owner), world=2)
    assert a.spec.block_bytes == 2 * PAGE * BPC  # a slot holds both ranks' parts
    keys = _keys(2)
    assert a.store(keys, [0, 1, 2, 3]).success
    for _, kv, _ in b.ranks:
        kv.zero_()
    spec, result = b.load(keys, _gpu([4, 5, 6, 7]))
    assert spec.pinned == 2 and result.success
    b.manager.complete_load(keys, None)
    for (_, kv_a, _), (_, kv_b, _) in zip(a.ranks, b.ranks):
        assert torch.equal(kv_b[4:8], kv_a[0:4])  # each rank got its own bytes back, not the other's
    assert not torch.equal(a.ranks[0][1][0:4], a.ranks[1][1][0:4])


def test_an_engine_started_before_its_owner_joins_it_later(engines):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    late = Owner()  # not started: the engine starts all the same, its calls are misses
    try:
        a, b = engines(_tiers(late)), engines(_tiers(late))
        keys = _keys(2)
        assert b.lookup(keys[0]) is LookupResult.MISS
        assert a.manager.prepare_store(keys, ReqContext("r")) is None
        late.start()
        time.sleep(1.1)  # (the client's backoff after a failed call)
        assert a.store(keys, [0, 1, 2, 3]).success
        _wait_for(lambda: b.lookup(keys[0]) is LookupResult.HIT)
    finally:
        late.close()


def test_vllms_own_connector_is_warned_about_failed_loads(owner, engines, caplog):
    from vllm.v1.kv_offload.base import ReqContext

    plain, reported = engines(_tiers(owner)), engines(_tiers(owner))
    reported.manager.direct_file_loads.enable()  # what KVTierOffloadingConnector does when it adopts the manager
    with caplog.at_level("WARNING", logger="kvtier.integrations.vllm.host_manager"):
        reported.manager.on_new_request(ReqContext("r1"))
        assert not caplog.records
        plain.manager.on_new_request(ReqContext("r1"))
        plain.manager.on_new_request(ReqContext("r2"))
    assert len(caplog.records) == 1 and "KVTierOffloadingConnector" in caplog.text


def test_with_several_kv_groups_a_partly_pinned_load_copies_nothing(owner, engines):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, make_offload_key

    a, b = engines(_tiers(owner)), engines(_tiers(owner))
    keys = [make_offload_key(i.to_bytes(32, "big"), group) for group in (0, 1) for i in (1, 2)]
    assert a.store(keys[:3], list(range(6))).success  # the last key (group 1) is not in the owner
    b.kv.zero_()
    gpu = GPULoadStoreSpec(list(range(8)), group_sizes=[4, 4], block_indices=[0, 0])
    spec, result = b.load(keys, gpu)
    assert spec.pinned == 3 and not result.success
    assert b.worker.take_failure(result.job_id) == (keys[3:], 3)  # only the unpinned key failed
    assert not b.kv.any()  # nothing copied: the connector fails the whole request (several groups)
    b.manager.complete_failed_load(keys, None, keys[3:])
    assert b.manager.tier_stats()["cpu"]["resident_blocks"] == 3  # the pinned keys stay, unpinned


@pytest.mark.parametrize("hinted", [True, False])
def test_a_sessions_retention_hint_reaches_the_owner(owner, engines, hinted):
    """A request's `kv_transfer_params["kvtier"]` hint keeps its session's blocks in the shared
    tier while another engine's traffic goes through it; an invalid hint is ignored, not fatal."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a, b = engines(_tiers(owner, cpu_blocks=8, disk=False)), engines(_tiers(owner, cpu_blocks=8, disk=False))
    params = {"kvtier": {"session": "chat-7", "retain_s": 600}} if hinted else {"kvtier": {"retain_s": "x"}}
    keys = _keys(2)
    out = a.manager.prepare_store(keys, ReqContext("chat", kv_transfer_params=params))
    assert out is not None and out.keys_to_store == keys
    result = a.run("submit_store", _gpu(list(range(4))), out.store_spec)
    a.manager.complete_store(keys, ReqContext("chat"), success=result.success)
    for start in range(100, 124, 4):  # another engine's traffic: 24 blocks through an 8-block tier
        b.store(_keys(4, start), list(range(8)))
    assert [b.lookup(k) for k in keys] == [LookupResult.HIT if hinted else LookupResult.MISS] * 2
