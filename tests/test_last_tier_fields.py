"""`cascade` or `reserve` given on a tier with no tier below it in the cascade chain (the last local
tier, or a shared tier: fed by publishing, outside the chain) would have no effect: the config
refuses it, as it refuses every other problem, naming the field, what is wrong and what would do.
Before the fix both were accepted without a word. `cascade: none` and `reserve: 0` say what
happens there and are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.config import load_config_text
from kvtier.core.errors import ConfigError

SHIPPED = sorted((Path(__file__).resolve().parents[1] / "kvtier" / "configs").glob("*.yaml"))


def problems(text: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config_text(text)
    return dict(info.value.problems)


def two_memory_tiers(last: str) -> str:
    return ("tiers:\n  - {name: hot, backend: memory, capacity: 8 blocks}\n"
            f"  - {{name: warm, backend: memory, capacity: 16 blocks{last}}}\n")


@pytest.mark.parametrize("mode", ["on_evict", "on_store"])
def test_a_cascade_on_the_last_tier_is_refused_naming_tier_and_field(mode):
    found = problems(two_memory_tiers(f", cascade: {mode}"))
    assert list(found) == ["tiers[1].cascade"]
    assert found["tiers[1].cascade"] == (
        f"cascade: {mode} has no effect on 'warm', the last tier of the cascade chain: there is no tier below it "
        "to copy blocks to; remove it (or write cascade: none), or add a tier below it")


def test_a_reserve_on_the_last_tier_is_refused_naming_tier_and_field():
    found = problems(two_memory_tiers(", reserve: 0.2"))
    assert found == {"tiers[1].reserve": (
        "reserve: 0.2 has no effect on 'warm', the last tier of the cascade chain: a reserve is kept free by "
        "copying blocks to the tier below, and there is none; remove it (or write reserve: 0), or add a tier "
        "below it")}


def test_a_single_tier_is_the_last_one_and_every_problem_is_reported_at_once():
    found = problems("tiers:\n  - {name: only, backend: memory, capacity: 8GB, cascade: on_store, reserve: 0.5}\n")
    assert set(found) == {"tiers[0].capacity", "tiers[0].cascade", "tiers[0].reserve"}
    assert "'only', the last tier of the cascade chain" in found["tiers[0].cascade"]


def test_none_and_zero_on_the_last_tier_and_fields_above_it_are_accepted():
    config = load_config_text(
        "tiers:\n  - {name: hot, backend: memory, capacity: 8 blocks, cascade: on_store, reserve: 0.3}\n"
        "  - {name: warm, backend: memory, capacity: 16 blocks, cascade: none, reserve: 0}\n")
    assert [(t.cascade, t.reserve) for t in config.tiers] == [("on_store", 0.3), ("none", 0.0)]


def test_an_invalid_value_there_is_reported_once_as_invalid():
    found = problems(two_memory_tiers(", cascade: sometimes, reserve: 0.9"))
    assert set(found) == {"tiers[1].cascade", "tiers[1].reserve"}
    assert "is not one of" in found["tiers[1].cascade"] and "between 0 and 0.5" in found["tiers[1].reserve"]


def test_before_a_shared_tier_the_chain_ends_and_the_shared_tier_is_outside_it():
    found = problems(
        "tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks}\n"
        "  - {name: nvme, backend: file, capacity: 16 blocks, root_dir: /tmp/kvtier-never-created, "
        "cascade: on_store}\n"
        "  - {name: shared, backend: valkey, capacity: 64 blocks, url: 'redis://127.0.0.1:6379', reserve: 0.1}\n")
    assert set(found) == {"tiers[1].cascade", "tiers[2].reserve"}
    assert ("'nvme', the last tier of the cascade chain (shared tier 'shared' after it is fed by publishing)"
            in found["tiers[1].cascade"])
    assert found["tiers[2].reserve"] == (
        "reserve: 0.1 has no effect on shared tier 'shared', outside the cascade chain (fed by publishing tier 0's "
        "stores): a reserve is kept free by copying blocks to the tier below, and there is none; remove it")


def test_config_check_lists_it_and_exits_2(tmp_path, capsys):
    path = tmp_path / "tiers.yaml"
    path.write_text(two_memory_tiers(", cascade: on_evict, reserve: 0.25"))
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: 2 problem(s):" in err
    assert "  tiers[1].cascade: cascade: on_evict has no effect on 'warm'" in err
    assert "  tiers[1].reserve: reserve: 0.25 has no effect on 'warm'" in err


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_configs_set_neither_on_their_last_tier(path):
    assert load_config_text(path.read_text(), str(path), import_code=False).tiers
