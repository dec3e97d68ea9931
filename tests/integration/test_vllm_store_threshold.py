"""Store threshold (issue 29, item 5): a block is stored only once it was offered N times.

The same offers go to vLLM's `CPUOffloadingManager(store_threshold=, max_tracker_size=)` and to
kvtier's adapter and `LRUOffloadingManager`: the same keys are stored, the same evicted, the same
number skipped. The option comes from kvtier's YAML or vLLM's `extra_config` (which wins), and
the skips are exported under vLLM's `vllm:kv_offload_stores_skipped`.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

from test_vllm_recency import _key, _name  # noqa: E402
from test_vllm_spec import _config  # noqa: E402

SKIPPED = "vllm:kv_offload_stores_skipped"
# Offers, one prepare_store each (one request each): repeats reach the threshold; the tracker (3
# keys) forgets the least recently offered; a table full of keys counted again by the same call
# leaves a new key uncounted.
OFFERS = [["a", "b"], ["a", "c"], ["b", "c"], ["d", "e", "f"], ["a"], ["d", "e", "f"], ["g", "h"],
          ["g", "h"], ["a", "b", "c", "d"], ["a", "b", "c", "d"], ["x"], ["x"]]


def _vllm(threshold, tracker, blocks):
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=blocks, cache_policy="lru", store_threshold=threshold,
                                max_tracker_size=tracker)


def _adapter(threshold, tracker, blocks, yaml_threshold=0):
    from kvtier.config import parse_config
    from kvtier.control.hierarchy import build_hierarchy
    from kvtier.integrations.vllm.manager import KVTierOffloadingManager

    config = parse_config({"store_threshold": yaml_threshold,
                           "tiers": [{"name": "cpu", "backend": "cpu", "capacity": f"{blocks} blocks",
                                      "policy": "lru"}]})
    return KVTierOffloadingManager(build_hierarchy(config, block_bytes=64, dry_run=True),
                                   store_threshold=threshold, max_tracker_size=tracker)


def _lru_manager(threshold, tracker, blocks):
    from kvtier import LRUOffloadingManager
    from kvtier.tiers.memory import SlotBackend

    return LRUOffloadingManager(SlotBackend("cpu", blocks, 0, block_size=16), store_threshold=threshold,
                                max_tracker_size=tracker)


def _offer(manager, offers):
    """Each offer as one request's store; returns (stored, evicted) name lists per offer."""
    from vllm.v1.kv_offload.base import ReqContext

    seen = []
    for i, names in enumerate(offers):
        ctx = ReqContext(f"r{i}")
        manager.on_new_request(ctx)
        out = manager.prepare_store([_key(n) for n in names], ctx)
        if out is None:
            seen.append(None)
        else:
            manager.complete_store(out.keys_to_store, ctx)
            seen.append((sorted(map(_name, out.keys_to_store)), sorted(map(_name, out.evicted_keys))))
        manager.on_request_finished(ctx)
    return seen


@pytest.mark.parametrize("threshold", [0, 1, 2, 3])
def test_the_same_offers_store_and_skip_what_vllm_does(threshold):
    reference = _vllm(threshold, 3, 5)
    expected = _offer(reference, OFFERS)
    for manager in (_adapter(threshold, 3, 5), _lru_manager(threshold, 3, 5)):
        assert _offer(manager, OFFERS) == expected
        assert manager.store_threshold.skipped == reference.stores_skipped_in_current_batch


def test_one_time_prompts_stay_out_of_the_tier():
    m = _adapter(2, 64_000, 4)
    assert _offer(m, [["a", "b"], ["c", "d"], ["a", "b"]]) == [([], []), ([], []), (["a", "b"], [])]
    assert m.store_threshold.skipped == 4


def test_the_yaml_threshold_applies_unless_the_adapter_is_given_one():
    assert _offer(_adapter(None, 100, 4, yaml_threshold=2), [["a"], ["a"]]) == [([], []), (["a"], [])]
    assert _offer(_adapter(0, 100, 4, yaml_threshold=2), [["a"]]) == [(["a"], [])]


def _spec(tmp_path, extra):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    config = _config(tmp_path, events=False, kvtier_config={"store_threshold": 3, "tiers": [
        {"name": "cpu", "backend": "cpu", "capacity": "4 blocks"}]})
    return KVTierOffloadingSpec(dataclasses.replace(config, extra_config={**config.extra_config, **extra}))


@pytest.mark.parametrize(("extra", "threshold"), [({}, 3), ({"store_threshold": 2}, 2), ({"store_threshold": 0}, 0)])
def test_extra_config_wins_over_the_yaml(tmp_path, extra, threshold):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    spec = _spec(tmp_path, {**extra, "max_tracker_size": 7})
    manager = spec.get_manager()
    try:
        assert manager.store_threshold.threshold == threshold
        assert manager.store_threshold.max_tracker_size == 7
        defs = KVTierOffloadingSpec.build_metric_definitions(spec.extra_config)
        assert (SKIPPED in defs) == (threshold >= 2)
    finally:
        manager.shutdown()


def test_skips_are_exported_under_vllms_name(tmp_path):
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    spec = _spec(tmp_path, {"store_threshold": 2})
    manager = spec.get_manager()
    try:
        theirs = CPUOffloadingSpec.build_metric_definitions({"store_threshold": 2})[SKIPPED]
        ours = type(spec).build_metric_definitions(spec.extra_config)[SKIPPED]
        assert type(ours) is type(theirs) and tuple(ours.labelnames) == tuple(theirs.labelnames)
        _offer(manager, [["a", "b", "c"]])
        assert manager.get_stats().data["data"][SKIPPED][()] == 3
        _offer(manager, [["a"]])
        assert manager.get_stats().data["data"][SKIPPED][()] == 0  # a delta: a was stored
    finally:
        manager.shutdown()
