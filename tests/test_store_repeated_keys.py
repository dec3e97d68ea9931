"""A key given more than once to `prepare_store` is stored once: one slot, listed once, so the
tier never loses a slot to a key written twice (every front end meets in `StorePath.prepare`;
the host owner's socket in tests/host/test_host_repeated_keys.py)."""

from __future__ import annotations

import pytest

from kvtier import build_hierarchy, load_config_text, make_offload_key


def _keys(n):
    return [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(n)]


@pytest.mark.parametrize("policy", ["lru", "arc", "sieve", "prefix-freq"])
def test_every_slot_stays_usable_when_each_key_is_given_twice(policy):
    hierarchy = build_hierarchy(load_config_text(f"""
block_bytes: 64B
tiers:
  - {{name: hot, backend: memory, capacity: 4 blocks, policy: {policy}}}
"""))
    try:
        manager = hierarchy.manager
        for key in _keys(4):
            out = manager.prepare_store([key, key])
            assert out is not None, "a tier with free slots has room"
            assert list(out.keys_to_store) == [key]
            assert len(out.store_spec.block_ids) == 1
            manager.complete_store([key, key])
        tier = manager.tiers[0]
        assert len(tier.table) == 4
        assert tier.backend.get_num_free_blocks() == 0
        assert manager.get_stats()["hot"]["resident_blocks"] == 4
    finally:
        hierarchy.close()


def test_a_repeated_key_among_resident_ones_takes_one_slot():
    hierarchy = build_hierarchy(load_config_text("""
block_bytes: 64B
tiers:
  - {name: hot, backend: memory, capacity: 4 blocks}
"""))
    try:
        manager = hierarchy.manager
        a, b = _keys(2)
        out = manager.prepare_store([a])
        manager.complete_store(out.keys_to_store)
        out = manager.prepare_store([a, b, b, a, b])
        assert list(out.keys_to_store) == [b]
        manager.complete_store([a, b, b, a, b])
        assert manager.tiers[0].backend.get_num_free_blocks() == 2
    finally:
        hierarchy.close()
