"""kvtier's policies inside vLLM 0.32's own `CPUOffloadingManager`, loaded the way a user's config
loads them: `cache_policy=<Class>`, `cache_policy_module_path="kvtier.integrations.vllm.policies"`
(vLLM's `CachePolicyFactory`). The manager is vLLM's, unchanged; only the eviction order is kvtier's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_spec import _keys  # noqa: E402

MODULE = "kvtier.integrations.vllm.policies"
ADAPTERS = {"LRUPolicy": "lru", "ARCPolicy": "arc", "SievePolicy": "sieve", "PrefixFreqPolicy": "prefix-freq"}


def _manager(policy: str, blocks: int, module: str | None = MODULE):
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=blocks, cache_policy=policy, cache_policy_module_path=module)


def _store(m, keys, ctx):
    """One store job of `keys`, completed; returns the keys it evicted (None: no room)."""
    out = m.prepare_store(keys, ctx)
    if out is None:
        return None
    m.complete_store(out.keys_to_store, ctx)
    return list(out.evicted_keys)


def _request(m, name, load=(), store=()):
    """A request as vLLM's connector drives the manager: loads its hits, stores its new blocks,
    finishes (vLLM records its accesses then). Returns what its store evicted."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(name)
    m.on_new_request(ctx)
    if load:
        m.prepare_load(list(load), ctx)
        m.complete_load(list(load), ctx)
    evicted = _store(m, list(store), ctx) if store else []
    m.on_request_finished(ctx)
    return evicted


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_each_adapter_runs_inside_vllms_manager(name):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm import policies

    m = _manager(name, blocks=4)
    assert isinstance(m._policy, getattr(policies, name))  # vLLM's factory found kvtier's class
    assert m._policy.policy is not None and type(m._policy).kvtier_policy == ADAPTERS[name]
    keys, ctx = _keys(6), ReqContext("r")
    assert _store(m, keys[:4], ctx) == []
    assert [m.lookup(k, ctx) for k in keys[:4]] == [LookupResult.HIT] * 4
    # a load pins its blocks: they are never evicted while pinned, and the store makes room elsewhere
    m.prepare_load(keys[:2], ctx)
    evicted = _store(m, keys[4:6], ctx)
    assert sorted(evicted) == sorted(keys[2:4])
    m.prepare_load(keys[4:6], ctx)
    assert _store(m, _keys(1, start=50), ctx) is None  # only pinned blocks left, nothing evicted
    assert [m.lookup(k, ctx) for k in keys[:2] + keys[4:6]] == [LookupResult.HIT] * 4
    m.complete_load(keys[:2] + keys[4:6], ctx)
    # a failed store frees its slot and is forgotten by the kvtier policy too
    out = m.prepare_store(_keys(1, start=60), ctx)
    m.complete_store(out.keys_to_store, ctx, success=False)
    assert m.lookup(_keys(1, start=60)[0], ctx) is LookupResult.MISS
    # the chunk ids vLLM allocated are the ones it gets back: evicted slots are reused, none lost
    stored = keys + _keys(1, start=50) + _keys(1, start=60)  # every key a store offered
    ids = sorted(m._policy.get(k).chunk_id for k in stored if m._policy.get(k) is not None)
    assert len(ids) == len(set(ids)) == 3 and set(ids) <= set(range(4))  # (the failed store evicted one)
    assert sorted(m._policy.policy.keys()) == sorted(k for k in stored if m._policy.get(k) is not None)
    m.reset_cache()
    assert m.lookup(keys[0], ctx) is LookupResult.MISS
    assert all(m._policy.get(k) is None for k in stored) and not list(m._policy.policy.keys())


def test_lru_adapter_evicts_what_vllms_own_lru_evicts():
    """The same requests on vLLM's manager with vLLM's `lru` and with kvtier's `LRUPolicy`."""
    keys = _keys(8)
    plays = [dict(store=keys[0:3]), dict(store=keys[3:4]), dict(load=keys[0:1]),
             dict(store=keys[4:6]), dict(load=keys[3:4]), dict(store=keys[6:8])]
    answers = []
    for policy, module in (("lru", None), ("LRUPolicy", MODULE)):
        m = _manager(policy, blocks=4, module=module)
        answers.append([_request(m, f"r{i}", **play) for i, play in enumerate(plays)])
    assert answers[0] == answers[1]
    assert answers[1][3] and answers[1][5]  # (the scenario does evict)


def test_prefix_freq_keeps_a_reused_prefix_that_lru_evicts():
    """kvtier's `prefix-freq` through vLLM's manager: a prefix loaded again and again survives a
    stream of one-time prompts that vLLM's LRU lets push it out."""
    from vllm.v1.kv_offload.base import ReqContext

    shared = _keys(2, start=100)
    results = {}
    for policy, module in (("lru", None), ("PrefixFreqPolicy", MODULE)):
        m = _manager(policy, blocks=6, module=module)
        _request(m, "first", store=shared)
        for i in range(3):
            _request(m, f"reuse{i}", load=shared)
        for i in range(4):  # one-time prompts of 2 blocks each
            _request(m, f"once{i}", store=_keys(2, start=10 * (i + 1)))
        results[policy] = [m.lookup(k, ReqContext("q")).name for k in shared]
    assert results["PrefixFreqPolicy"] == ["HIT", "HIT"]
    assert results["lru"] == ["MISS", "MISS"]


def test_a_block_a_request_only_inserted_is_not_counted_as_reused():
    """`on_request_finished` leaves out the keys the request only inserted (kvtier's touch is a reuse)."""
    from vllm.v1.kv_offload.base import ReqContext

    m = _manager("LRUPolicy", blocks=4)
    touched: list[list] = []
    real_touch = m._policy.policy.touch
    m._policy.policy.touch = lambda keys: (touched.append(list(keys)), real_touch(keys))
    old, new = _keys(1, start=1), _keys(1, start=2)
    _request(m, "a", store=old)
    touched.clear()
    ctx = ReqContext("b")
    m.on_new_request(ctx)
    m.prepare_load(old, ctx)
    m.complete_load(old, ctx)
    _store(m, new, ctx)
    m.on_request_finished(ctx)
    assert touched == [old]
