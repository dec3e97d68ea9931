"""Config validation: every mistake is reported at load time with the field path and a fix."""

import pytest

from kvtier import ConfigError, build_hierarchy, load_config, load_config_text, parse_size
from kvtier.config import Capacity, HierarchyConfig, TierConfig, default_config_path

GOOD_TIER = "{name: cpu, backend: memory, capacity: 8 blocks}"


def tiers(*items: str, head: str = "block_bytes: 1MiB\n") -> str:
    return head + "tiers:\n" + "".join(f"  - {item}\n" for item in items)


BROKEN = [
    # (yaml text, field path, fragment of the message)
    ("tiers: [", "", "invalid YAML at line"),
    ("- just\n- a list\n", "", "must be a mapping"),
    ("block_tokens: 256\n", "tiers", "missing"),
    ("tiers: []\n", "tiers", "non-empty list"),
    ("tiers: 3\n", "tiers", "non-empty list"),
    ("tiers:\n  - 5\n", "tiers[0]", "expected a mapping"),
    (tiers("{backend: memory, capacity: 8 blocks}"), "tiers[0].name", "missing"),
    (tiers("{name: cpu, capacity: 8 blocks}"), "tiers[0].backend", "missing"),
    (tiers("{name: cpu, backend: memory}"), "tiers[0].capacity", "missing"),
    (tiers("{name: cpu, backend: memroy, capacity: 8 blocks}"), "tiers[0].backend", "did you mean 'memory'"),
    (tiers("{name: cpu, backend: nosuch.module:Thing, capacity: 8 blocks}"), "tiers[0].backend", "unknown backend"),
    (tiers("{name: cpu, backend: memory, capacity: 64GB}"), "tiers[0].capacity", "did you mean '64GiB'"),
    (tiers("{name: cpu, backend: memory, capacity: 64}"), "tiers[0].capacity", "ambiguous"),
    (tiers("{name: cpu, backend: memory, capacity: lots}"), "tiers[0].capacity", "is not a size"),
    (tiers("{name: cpu, backend: memory, capacity: 0 blocks}"), "tiers[0].capacity", "at least 1 block"),
    (tiers("{name: cpu, backend: memory, capacity: 0GiB}"), "tiers[0].capacity", "must be > 0"),
    (tiers("{name: cpu, backend: memory, capacity: 64Zb}"), "tiers[0].capacity", "unknown unit"),
    (tiers("{name: cpu, backend: memory, capacity: 512KiB}"), "tiers[0].capacity", "smaller than one block"),
    (tiers("{name: cpu, backend: memory, capacity: [1]}"), "tiers[0].capacity", "expected a size"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, policy: lfu2}"), "tiers[0].policy", "unknown policy"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, policy: lr}"), "tiers[0].policy", "did you mean 'lru'"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, cascade: sometimes}"), "tiers[0].cascade",
     "not one of on_evict, on_store, none"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, reserve: 0.9}"), "tiers[0].reserve", "between 0 and 0.5"),
    (tiers("{name: cpu, backend: memory, capacity: 8 blocks, capacty: 3}"), "tiers[0].capacty",
     "did you mean 'capacity'"),
    (tiers("{name: CPU, backend: memory, capacity: 8 blocks}"), "tiers[0].name", "not a valid tier name"),
    (tiers(GOOD_TIER, GOOD_TIER), "tiers[1].name", "duplicate tier name 'cpu'"),
    ("block_tokens: -4\n" + tiers(GOOD_TIER, head=""), "block_tokens", "positive integer"),
    ("block_tokens: many\n" + tiers(GOOD_TIER, head=""), "block_tokens", "positive integer"),
    ("block_bytes: 2MB\n" + tiers(GOOD_TIER, head=""), "block_bytes", "did you mean '2MiB'"),
    ("blocks_tokens: 4\n" + tiers(GOOD_TIER, head=""), "blocks_tokens", "did you mean 'block_tokens'"),
    (tiers(GOOD_TIER, "{name: far, backend: tests.test_config:NoHandlerBackend, capacity: 8 blocks}"),
     "tiers[0].cascade", "no handler moves blocks"),
]


class _OddSpec:  # a spec type no handler knows
    pass


class NoHandlerBackend:  # referenced from YAML above as tests.test_config:NoHandlerBackend
    from kvtier.specs import BlockIDsLoadStoreSpec as _Base

    spec_type = type("OddLoadStoreSpec", (_Base,), {"medium": staticmethod(lambda: "ODD")})
    OPTIONS: dict = {}


@pytest.mark.parametrize("text, path, fragment", BROKEN, ids=[f"{i:02d}-{b[1] or 'root'}" for i, b in enumerate(BROKEN)])
def test_broken_config_names_the_field(text, path, fragment):
    with pytest.raises(ConfigError) as info:
        load_config_text(text, "test.yaml")
    problems = info.value.problems
    assert any(p == path and fragment in m for p, m in problems), problems


def test_all_problems_are_reported_at_once():
    text = tiers("{name: cpu, backend: memory, capacity: 64GB, policy: nope, extra: 1}")
    with pytest.raises(ConfigError) as info:
        load_config_text(text)
    paths = sorted(p for p, _ in info.value.problems)
    assert paths == ["tiers[0].capacity", "tiers[0].extra", "tiers[0].policy"]


def test_config_error_is_a_value_error_with_readable_text():
    with pytest.raises(ValueError, match=r"tiers\[0\]\.capacity: .*64GiB"):
        load_config_text(tiers("{name: cpu, backend: memory, capacity: 64GB}"))


def test_valid_config_is_frozen_with_defaults_on_fields():
    cfg = load_config_text(tiers(GOOD_TIER))
    tier = cfg.tiers[0]
    assert (tier.policy, tier.cascade, tier.reserve, cfg.block_tokens) == ("prefix-freq", "on_evict", 0.1, 256)
    with pytest.raises(AttributeError):
        tier.policy = "arc"
    with pytest.raises(TypeError):
        tier.options["x"] = 1


def test_policy_defaults_per_tier_and_a_named_policy_wins():
    cfg = load_config_text("""
tiers:
  - {name: hot, backend: memory, capacity: 8 blocks}
  - {name: warm, backend: memory, capacity: 16 blocks}
  - {name: cold, backend: memory, capacity: 32 blocks, policy: arc}
  - {name: last, backend: memory, capacity: 64 blocks, policy: null}
""")
    assert [t.policy for t in cfg.tiers] == ["prefix-freq", "lru", "arc", "lru"]
    hierarchy = build_hierarchy(cfg, dry_run=True)
    try:
        assert [type(t.policy).__name__ for t in hierarchy.manager.tiers] == [
            "PrefixFreqCachePolicy", "LRUCachePolicy", "ARCCachePolicy", "LRUCachePolicy"]
    finally:
        hierarchy.close()


def test_block_counts_take_k_and_m_like_the_cli():
    assert [Capacity.parse(t).blocks for t in ("10000 blocks", "10k blocks", "2M blocks", "1 block")] == \
        [10000, 10000, 2_000_000, 1]
    with pytest.raises(ValueError):
        Capacity.parse("10x blocks")


def test_tiers_built_in_code_get_the_same_default_policies():
    cfg = HierarchyConfig((TierConfig("a", "memory", Capacity(blocks=4)), TierConfig("b", "memory", Capacity(blocks=8)),
                           TierConfig("c", "memory", Capacity(blocks=8), policy="arc")))
    assert [t.policy for t in cfg.tiers] == ["prefix-freq", "lru", "arc"]


def test_sizes_use_binary_units():
    assert parse_size("64GiB") == 64 << 30 and parse_size("1.5MiB") == 3 << 19 and parse_size("4096B") == 4096


def test_shipped_configs_load():
    assert load_config(default_config_path()).tiers[1].options["root_dir"]
    for path in default_config_path().parent.glob("*.yaml"):
        load_config(path)


@pytest.mark.parametrize("backend, capacity, extra", [
    ("memory", "64TiB", ""),
    ("cpu", "64TiB", ""),
    ("file", "1000TiB", ", root_dir: ROOT"),
])
def test_capacity_above_free_memory_or_disk_is_a_config_error(tmp_path, backend, capacity, extra):
    from kvtier import build_hierarchy

    text = tiers("{name: big, backend: %s, capacity: %s%s}" % (backend, capacity, extra.replace("ROOT", str(tmp_path))))
    with pytest.raises(ConfigError) as info:
        build_hierarchy(load_config_text(text))
    [(path, message)] = info.value.problems
    assert path == "tiers[0].capacity" and ("more than the" in message or "does not fit" in message)
    assert not any(tmp_path.iterdir())  # nothing allocated
