"""What the vLLM connector takes as input, checked without vLLM: `kv_connector_extra_config`'s
keys (`kvtier.config.vllm.read_extra_config`), the per-rank options of a kvtier config under vLLM
(`vllm_hierarchy_config`, `kvtier config check --vllm`), and docs/vllm.md's "Try it" program run
as a file (vLLM's engine core process imports it again)."""

from __future__ import annotations

import re
import runpy
import sys
import types
from pathlib import Path

import pytest
from test_config_env import check  # config check FILE FLAGS -> (exit status, stdout, stderr)

from kvtier.config.vllm import vllm_hierarchy_config
from kvtier.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
YAML_THRESHOLD_MESSAGE = "expected 0 (off) or a number of offers up to 1048576, got "


# ------------------------------------------------------------------ docs/vllm.md, "Try it" (defect 1)
def _try_it_block() -> str:
    text = (REPO / "docs" / "vllm.md").read_text()
    match = re.search(r"<!-- docs-test: python with MODEL = [^\n]*-->\n```python\n(.*?)\n```", text, re.S)
    assert match, "docs/vllm.md has its Try it block"
    return match.group(1)


def _fake_vllm(monkeypatch) -> list[dict]:
    """Stand-ins for the vllm modules the block imports; returns the LLM(...) calls they see."""
    started: list[dict] = []

    class LLM:
        def __init__(self, **kwargs):
            started.append(kwargs)
            raise SystemExit("engine started")  # (the rest of the block is not run)

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, lambda **kw: kw  # type: ignore[attr-defined]
    config = types.ModuleType("vllm.config")
    config.KVTransferConfig = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", config)
    return started


def test_the_try_it_program_saved_as_a_file_starts_no_engine_when_imported_again(tmp_path, monkeypatch):
    """multiprocessing's spawn (vLLM's engine core) runs the user's file again as `__mp_main__`:
    the block must start its engine only as `__main__`, else the child starts one too and fails."""
    started = _fake_vllm(monkeypatch)
    path = tmp_path / "try_kvtier.py"
    path.write_text(_try_it_block())
    runpy.run_path(str(path), run_name="__mp_main__")
    assert started == []
    with pytest.raises(SystemExit, match="engine started"):
        runpy.run_path(str(path), run_name="__main__")
    assert len(started) == 1 and started[0]["enable_prefix_caching"] is True


# ------------------------------------------------------------------ kv_connector_extra_config (defects 2, 6)
def read_extra_config(extra: dict, own_keys: tuple[str, ...] = ()) -> dict:
    from kvtier.config.vllm import read_extra_config

    return read_extra_config(extra, own_keys)


def test_a_misspelt_key_is_refused_with_the_closest_known_key():
    with pytest.raises(ConfigError) as info:
        read_extra_config({"spec_name": "KVTierOffloadingSpec", "kvtier_confg": {"tiers": []}})
    [(path, message)] = info.value.problems
    assert path == "kv_connector_extra_config.kvtier_confg"
    assert "did you mean 'kvtier_config'?" in message
    assert info.value.source == "kv_connector_extra_config"


def test_the_keys_a_spec_subclass_reads_itself_are_accepted():
    """A subclass of KVTierOffloadingSpec names its own keys (`own_extra_keys`): before, the
    first version of this check refused the test suite's FailingLoadSpec's `fail_loads`."""
    assert read_extra_config({"fail_loads": 2}, own_keys=("fail_loads",))["store_threshold"] is None
    with pytest.raises(ConfigError, match="fail_loads: unknown key"):
        read_extra_config({"fail_loads": 2})


def test_the_keys_vllm_reads_are_accepted():
    extra = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
             "block_size": 256, "blocks_per_chunk": 16, "canonical_layout": False,
             "self_describing_kv_events": True, "offload_prompt_only": True, "cpu_bytes_to_use": 1 << 30,
             "eviction_policy": "lru", "cache_policy_module_path": "kvtier.integrations.vllm.policies",
             "kvtier_config": "x.yaml", "direct_file_loads": "true", "store_threshold": 2, "max_tracker_size": 10}
    values = read_extra_config(extra)
    assert values == {"kvtier_config": "x.yaml", "direct_file_loads": True, "store_threshold": 2,
                      "max_tracker_size": 10}
    assert read_extra_config({}) == dict.fromkeys(values)  # none given: the defaults
    assert read_extra_config({"store_threshold": None})["store_threshold"] is None  # null: not given


@pytest.mark.parametrize("value", ["abc", "3", 2.7, True, -1, 10**9])
def test_the_store_threshold_is_checked_as_the_yamls(value):
    with pytest.raises(ConfigError) as info:
        read_extra_config({"store_threshold": value})
    [(path, message)] = info.value.problems
    assert path == "kv_connector_extra_config.store_threshold"
    assert message.startswith(YAML_THRESHOLD_MESSAGE)
    with pytest.raises(ConfigError) as yaml:  # the same rule and message as the YAML's
        vllm_hierarchy_config({"store_threshold": value, "tiers": [{"name": "cpu", "backend": "cpu",
                                                                     "capacity": "2 blocks"}]},
                              block_tokens=16, engine_id="e")
    assert dict(yaml.value.problems)["store_threshold"] == message


@pytest.mark.parametrize("value", ["abc", 2.7, True, 0, -5, 1 << 30])
def test_max_tracker_size_is_a_bounded_positive_integer(value):
    with pytest.raises(ConfigError) as info:
        read_extra_config({"store_threshold": 2, "max_tracker_size": value})
    [(path, message)] = info.value.problems
    assert path == "kv_connector_extra_config.max_tracker_size"
    assert message.startswith("expected a positive integer up to ")


def test_every_problem_of_the_extra_config_is_listed():
    with pytest.raises(ConfigError) as info:
        read_extra_config({"store_treshold": 2, "max_tracker_size": 0, "direct_file_loads": "yes"})
    assert [path for path, _ in info.value.problems] == [
        "kv_connector_extra_config.store_treshold", "kv_connector_extra_config.direct_file_loads",
        "kv_connector_extra_config.max_tracker_size"]
    assert "did you mean 'store_threshold'?" in info.value.problems[0][1]


# ------------------------------------------------------------------ tp / part_checks (defect 7)
def _tiers(file_options: dict, valkey_options: dict, cpu_capacity: str = "4 blocks") -> dict:
    return {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": cpu_capacity},
                      {"name": "nvme", "backend": "file", "root_dir": "/nonexistent/kvtier", "capacity": "16 blocks",
                       **file_options},
                      {"name": "shared", "backend": "valkey", "capacity": "8 blocks", "url": "redis://127.0.0.1:1",
                       **valkey_options}]}


def test_null_per_rank_options_mean_the_engines_value():
    config = vllm_hierarchy_config(_tiers({"part_checks": None}, {"tp": None}), block_tokens=16, engine_id="e",
                                   ranks=2)
    assert config.tiers[1].options["part_checks"] == 2 and config.tiers[2].options["tp"] == 2


def test_a_per_rank_mismatch_is_reported_with_every_other_problem():
    raw = _tiers({"part_checks": 2}, {"tp": True}, cpu_capacity="4 GB")
    with pytest.raises(ConfigError) as info:
        vllm_hierarchy_config(raw, block_tokens=16, engine_id="e", source="x.yaml", ranks=1)
    problems = dict(info.value.problems)
    assert set(problems) == {"tiers[1].part_checks", "tiers[2].tp", "tiers[0].capacity"}
    assert problems["tiers[1].part_checks"].startswith("2 in x.yaml, but this engine has 1 tensor-parallel ranks")
    assert "did you mean '4GiB'?" in problems["tiers[0].capacity"]
    assert info.value.source == "x.yaml"


def test_config_check_vllm_lists_every_problem_and_takes_null_as_not_given(tmp_path, capsys):
    tiers = ("tiers:\n  - {name: cpu, backend: cpu, capacity: 4 GB}\n"
             f"  - {{name: nvme, backend: file, root_dir: '{tmp_path / 'tier'}', capacity: 16 blocks, "
             "part_checks: 2}\n"
             "  - {name: shared, backend: valkey, capacity: 8 blocks, url: 'redis://127.0.0.1:1', tp: 4}\n")
    code, _, err = check(tmp_path, tiers, capsys, "--vllm")
    assert code == 2
    assert "tiers[2].tp: 4 in" in err and "tiers[0].capacity: unknown unit 'GB'" in err
    nulls = tiers.replace("4 GB", "4GiB").replace("part_checks: 2", "part_checks: null").replace("tp: 4", "tp: null")
    code, out, err = check(tmp_path, nulls, capsys, "--vllm")
    assert code == 0, err
    assert "part_checks=1" in out and "tp=1" in out
