"""Under vLLM, a block whose load failed is no tier's hit: `KVTierOffloadingManager`'s failed-load
path (what `KVTierOffloadingConnector` calls with the job's key set) counts it once, in the
failures of the tier it was read from, and counts as hits only the blocks that were loaded.

Before the fix every block of the load was a hit (counted when the load was prepared), the
failed one included. vLLM's real spec and worker (CPU tensors as KV cache), kvtier's real tiers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_direct_file_loads import Engine, _corrupt  # noqa: E402
from test_vllm_spec import _keys  # noqa: E402


@pytest.fixture
def engine(tmp_path):
    """A scheduler-side manager and a worker over CPU tensors, direct file loads on."""
    made = Engine(tmp_path)
    yield made
    made.close()


def _file_only(engine, ctx):
    """Four blocks stored, then pushed out of the 4-block CPU tier by four more: only on disk."""
    old = _keys(4)
    engine.store(old, 0, ctx)
    engine.store(_keys(4, start=10), 8, ctx)
    assert all(engine.file_tier().readable(k) is not None for k in old)
    return old


@pytest.mark.parametrize("named", [True, False])
def test_a_failed_direct_load_counts_no_hit_for_its_failed_blocks(engine, named):
    """Four file-tier blocks loaded directly, the second corrupted on disk. Named by the worker:
    it is counted once in the file tier's failures and no hit; the three loaded are its hits
    (vLLM completes the job's keys as a set). Not named (the whole job failed): no hit at all,
    each block one failure. `tier_stats()` and vLLM's `vllm:kvtier_hits` agree."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.integrations.vllm.connector import FailedKeys

    ctx = ReqContext("r")
    old = _file_only(engine, ctx)
    _corrupt(engine, old[1])
    m = engine.manager
    m.get_stats()  # (the deltas below are this load's)
    before = m.tier_stats()
    _, result = engine.load(old, 8, ctx)
    assert not result.success
    bad, first = engine.worker.take_failure(2)
    assert (bad, first) == ([bytes(old[1])], 1)
    keys = FailedKeys(old)  # what the connector completes: the job's key set
    keys.bad = set(bad) if named else None
    m.complete_failed_load(keys, ctx, keys.bad)
    after = m.tier_stats()
    hits, failures = (3, 1) if named else (0, 4)
    assert after["disk"]["hits"] - before["disk"]["hits"] == hits
    assert after["disk"]["failures"] - before["disk"]["failures"] == failures
    assert after["cpu"]["hits"] == before["cpu"]["hits"]
    data = m.get_stats().data["data"]
    assert data.get("vllm:kvtier_hits", {}).get(("disk",), 0) == hits
