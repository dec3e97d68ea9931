"""vLLM's own `vllm:kv_offload_*` names, exported by kvtier beside `vllm:kvtier_*`: the same names,
kinds, labels and buckets as vLLM 0.32's CPU and tiering specs, filled with the same meaning
(`kvtier.integrations.vllm.vllm_metrics`), on kvtier's real manager (CPU tier of 4 blocks, file
tier below, write-through)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_spec import BPC, PAGE, _config, _keys, _settle  # noqa: E402

BLOCK_BYTES = PAGE * BPC


def _vllm_definitions() -> dict:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    return TieringOffloadingSpec.build_metric_definitions({})  # the CPU spec's names and the tiering ones


def test_the_names_kinds_labels_and_buckets_are_vllms():
    from kvtier.integrations.vllm import KVTierOffloadingSpec
    from kvtier.integrations.vllm.vllm_metrics import vllm_metric_definitions

    ours, theirs = vllm_metric_definitions(), _vllm_definitions()
    assert ours and set(ours) <= set(theirs)
    for name, meta in ours.items():
        assert type(meta) is type(theirs[name]), name
        assert tuple(meta.labelnames) == tuple(theirs[name].labelnames), name
        assert getattr(meta, "buckets", None) == getattr(theirs[name], "buckets", None), name
    # exported by the spec, next to kvtier's own
    defs = KVTierOffloadingSpec.build_metric_definitions({})
    assert set(ours) <= set(defs) and "vllm:kvtier_stores" in defs
    assert "vllm:kv_offload_cpu_cache_usage_perc" in ours and "vllm:kv_offload_tiering_read_bytes" in ours


@pytest.fixture
def manager(tmp_path):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    m = KVTierOffloadingSpec(_config(tmp_path, events=False)).get_manager()
    yield m
    m.shutdown()


def _data(m) -> dict:
    return m.get_stats().data["data"]


def test_cpu_usage_and_allocation_sizes_have_vllms_meaning(manager):
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext("r0")
    keys = _keys(3)
    manager.prepare_store(keys, ctx)
    data = _data(manager)
    # 3 of the CPU tier's 4 blocks are being stored by the engine: pinned by writes, none by reads
    assert data["vllm:kv_offload_cpu_cache_usage_perc"][()] == 0.75
    assert data["vllm:kv_offload_cpu_cache_write_usage_perc"][()] == 0.75
    assert data["vllm:kv_offload_cpu_cache_read_usage_perc"][()] == 0.0
    assert data["vllm:kv_offload_cpu_allocation_size"][()] == [3]
    manager.complete_store(keys, ctx)
    _settle(manager)
    manager.prepare_load(keys[:2], ctx)
    data = _data(manager)
    # two blocks pinned by a load: read usage; the histogram holds only calls since the last report
    assert data["vllm:kv_offload_cpu_cache_write_usage_perc"][()] == 0.0
    assert data["vllm:kv_offload_cpu_cache_read_usage_perc"][()] == 0.5
    assert data["vllm:kv_offload_cpu_cache_usage_perc"][()] == 0.5
    assert "vllm:kv_offload_cpu_allocation_size" not in data
    manager.complete_load(keys[:2], ctx)
    assert _data(manager)["vllm:kv_offload_cpu_cache_usage_perc"][()] == 0.0


def test_lower_tier_reads_and_writes_are_vllms_tiering_counters(manager):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext("r0")
    keys = _keys(3)
    manager.complete_store(manager.prepare_store(keys, ctx).keys_to_store, ctx)
    _settle(manager)  # write-through: the 3 blocks are copied to the file tier
    data = _data(manager)
    assert data["vllm:kv_offload_tiering_write_bytes"] == {("disk",): 3 * BLOCK_BYTES}
    assert data["vllm:kv_offload_tiering_write_time"][("disk",)] > 0
    assert "vllm:kv_offload_tiering_read_bytes" not in data
    # push them out of the CPU tier, then read one back (promotion from the file tier)
    more = _keys(4, start=10)
    manager.complete_store(manager.prepare_store(more, ctx).keys_to_store, ctx)
    _settle(manager)
    assert manager.lookup(keys[0], ctx) is LookupResult.RETRY
    _settle(manager)
    assert manager.lookup(keys[0], ctx) is LookupResult.HIT
    data = _data(manager)
    assert data["vllm:kv_offload_tiering_read_bytes"] == {("disk",): BLOCK_BYTES}
    assert data["vllm:kv_offload_tiering_read_time"][("disk",)] > 0
    # counters are deltas, and the CPU tier itself is never labelled as a lower tier
    data = _data(manager)
    assert "vllm:kv_offload_tiering_read_bytes" not in data and "vllm:kv_offload_tiering_write_bytes" not in data
