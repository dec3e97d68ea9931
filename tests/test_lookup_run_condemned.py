"""`lookup_run` answers as `lookup` does key by key, also for a block that failed a read while
another load still pins it (condemned: never served again), in a one-tier hierarchy (the
standalone `load` and the host owner ask `lookup_run`) as in a two-tier one."""

from __future__ import annotations

import pytest

from kvtier import build_hierarchy, load_config_text, make_offload_key
from kvtier.core.types import LookupResult

ONE_TIER = """
block_bytes: 64B
tiers:
  - {name: hot, backend: memory, capacity: 4 blocks}
"""
TWO_TIERS = """
block_bytes: 64B
tiers:
  - {name: hot, backend: memory, capacity: 4 blocks, cascade: on_evict}
  - {name: cold, backend: memory, capacity: 8 blocks}
"""


@pytest.mark.parametrize("config", [ONE_TIER, TWO_TIERS], ids=["one tier", "two tiers"])
def test_a_condemned_block_is_a_miss_for_lookup_run_as_for_lookup(config):
    hierarchy = build_hierarchy(load_config_text(config))
    try:
        manager = hierarchy.manager
        a, b = (make_offload_key(i.to_bytes(8, "big"), 0) for i in range(2))
        manager.complete_store(manager.prepare_store([a, b]).keys_to_store)
        manager.prepare_load([b])
        manager.prepare_load([b])  # two loads pin it
        manager.complete_load([b], failed=[b])  # one failed: b is condemned, still pinned by the other
        assert manager.lookup(b) is LookupResult.MISS
        assert manager.lookup_run([b]) == (0, LookupResult.MISS)
        assert manager.lookup_run([a, b]) == (1, LookupResult.MISS)
    finally:
        hierarchy.close()
