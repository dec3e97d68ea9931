"""A policy written to vLLM's seed contract (no keys/len/clear) runs a hierarchy built from YAML
`policy: module:Class`: stores, evictions, cascade (on_store), stats and reset all work; asking
it to cascade on_evict (which needs `victims`) is refused up front."""

from __future__ import annotations

import pytest
from conftest import keys

from kvtier import ConfigError, LookupResult, build_hierarchy, load_config_text
from kvtier.policies.base import KeyIndex


def seed_hierarchy(hot_policy: str, warm_policy: str, cascade: str = "on_store"):
    text = f"""
block_bytes: 64B
tiers:
  - {{name: hot, backend: memory, capacity: 8 blocks, policy: "{hot_policy}", cascade: {cascade}}}
  - {{name: warm, backend: memory, capacity: 32 blocks, policy: "{warm_policy}"}}
"""
    return build_hierarchy(load_config_text(text))


def store(h, ks, ctx):
    out = h.manager.prepare_store(ks, ctx)
    assert out is not None
    hot = h.backends["hot"]
    for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
        hot.view(slot)[:] = (key * 8)[:64]
    h.manager.complete_store(out.keys_to_store, ctx)


def read(h, key, ctx) -> bytes:
    m = h.manager
    for _ in range(5):
        result = m.lookup(key, ctx)
        if result is LookupResult.HIT:
            break
        assert result is LookupResult.RETRY, result
        m.on_schedule_end()
    else:
        pytest.fail("block never came back")
    spec = m.prepare_load([key], ctx)
    data = bytes(h.backends[spec.tier].view(spec.block_ids[0]))
    m.complete_load([key], ctx)
    return data


@pytest.mark.parametrize("hot_policy, warm_policy", [
    ("seed_policy:SeedLRUPolicy", "seed_policy:DuckSeedPolicy"),
    ("seed_policy:DuckSeedPolicy", "lru"),
])
def test_seed_contract_policy_runs_a_hierarchy(ctx, hot_policy, warm_policy):
    h = seed_hierarchy(hot_policy, warm_policy)
    try:
        assert isinstance(h.manager.tiers[0].policy, KeyIndex)
        ks = keys(24)
        for i in range(0, 24, 4):
            store(h, ks[i:i + 4], ctx)
            h.manager.on_schedule_end()
        stats = h.manager.get_stats()
        assert stats["hot"]["evictions"] == 16 and stats["hot"]["cascade_dropped"] == 0
        assert stats["hot"]["resident_blocks"] == 8 - stats["hot"]["free_blocks"]
        assert stats["warm"]["resident_blocks"] >= 16
        for key in ks:
            assert read(h, key, ctx) == (key * 8)[:64]
        h.manager.reset_cache()
        stats = h.manager.get_stats()
        assert stats["hot"]["resident_blocks"] == 0 and stats["hot"]["free_blocks"] == 8
        assert stats["warm"]["resident_blocks"] == 0 and stats["warm"]["free_blocks"] == 32
        assert h.manager.lookup(ks[0], ctx) is LookupResult.MISS
    finally:
        h.close()


@pytest.mark.parametrize("policy", ["seed_policy:SeedLRUPolicy", "seed_policy:DuckSeedPolicy"])
def test_on_evict_cascade_with_a_policy_that_cannot_predict_victims_is_refused(policy):
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.cascade.*victims.*on_store"):
        seed_hierarchy(policy, "lru", cascade="on_evict")


def test_a_seed_policy_in_the_last_tier_may_keep_the_default_cascade():
    h = seed_hierarchy("lru", "seed_policy:SeedLRUPolicy", cascade="on_evict")
    h.close()


def test_config_check_with_import_code_refuses_it_as_the_build_does(tmp_path, capsys):
    """Before: `kvtier config check --import-code` passed this config (exit 0); only the build refused it."""
    from kvtier.cli.main import main

    path = tmp_path / "seed.yaml"
    path.write_text("tiers:\n  - {name: hot, backend: memory, capacity: 8 blocks, "
                    'policy: "seed_policy:SeedLRUPolicy"}\n  - {name: warm, backend: memory, capacity: 32 blocks}\n')
    assert main(["config", "check", "--import-code", str(path)]) == 2
    assert "tiers[0].cascade: 'on_evict' copies blocks down" in capsys.readouterr().err
