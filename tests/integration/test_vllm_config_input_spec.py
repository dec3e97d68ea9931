"""KVTierOffloadingSpec's input, without an engine: `kv_connector_extra_config` is refused at start
when a key is misspelt or a value is bad (before any tier is built); a problem of the kvtier config
names where it is (the file, or `kv_connector_extra_config.kvtier_config`); a relative path that is
not found names the directory looked in and kvtier's packaged config of that name; the default
config draws no warning about its block size."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

from test_vllm_spec import _config  # noqa: E402

PACKAGED = Path(__file__).resolve().parents[2] / "kvtier" / "configs"


def _tiers(tmp_path, **top) -> dict:
    return {**top, "tiers": [{"name": "cpu", "backend": "cpu", "capacity": "4 blocks"},
                             {"name": "disk", "backend": "file", "root_dir": str(tmp_path / "disk"),
                              "capacity": "16 blocks"}]}


def _spec(tmp_path, extra: dict, kvtier_config=None):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    config = _config(tmp_path, events=False, kvtier_config=_tiers(tmp_path))
    config = dataclasses.replace(config, extra_config={"kvtier_config": config.extra_config["kvtier_config"],
                                                       **extra})
    return KVTierOffloadingSpec(config)


def _refused(tmp_path, extra: dict):
    from kvtier.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _spec(tmp_path, extra)
    return info.value


# ------------------------------------------------------------------ defect 2: unknown keys
def test_a_misspelt_key_is_refused_at_start_naming_the_closest_key(tmp_path):
    error = _refused(tmp_path, {"kvtier_config": None, "kvtier_confg": _tiers(tmp_path)})
    assert "kv_connector_extra_config.kvtier_confg" in str(error)
    assert "did you mean 'kvtier_config'?" in str(error)


def test_the_keys_vllm_itself_reads_are_not_refused(tmp_path):
    spec = _spec(tmp_path, {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
                            "block_size": 32, "blocks_per_chunk": 2, "canonical_layout": False,
                            "self_describing_kv_events": False, "offload_prompt_only": True})
    assert [t.name for t in spec.hierarchy_config.tiers] == ["cpu", "disk"]


# ------------------------------------------------------------------ defect 6: store_threshold, max_tracker_size
@pytest.mark.parametrize(("key", "value"), [("store_threshold", "abc"), ("store_threshold", 2.7),
                                            ("store_threshold", True), ("store_threshold", 10**9),
                                            ("store_threshold", -1), ("max_tracker_size", "abc"),
                                            ("max_tracker_size", 0), ("max_tracker_size", 2.7)])
def test_a_bad_threshold_value_is_refused_at_start_naming_its_key(tmp_path, key, value):
    error = _refused(tmp_path, {"store_threshold": 2, key: value})
    assert [path for path, _ in error.problems] == [f"kv_connector_extra_config.{key}"]
    assert str(error).startswith(f"kv_connector_extra_config.{key}: expected ")


def test_a_refused_value_leaves_nothing_open(tmp_path):
    """The refusal comes before the tiers are built: a spec on the same root_dir starts after it."""
    _refused(tmp_path, {"store_threshold": 2, "max_tracker_size": 0})
    spec = _spec(tmp_path, {"store_threshold": 2, "max_tracker_size": 5})
    manager = spec.get_manager()
    try:
        assert manager.store_threshold.max_tracker_size == 5
    finally:
        spec.shutdown()


def test_the_metric_definitions_refuse_the_same_values():
    from kvtier.core.errors import ConfigError
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    for value in ("abc", 2.7, -3):
        with pytest.raises(ConfigError, match="kv_connector_extra_config.store_threshold: expected "):
            KVTierOffloadingSpec.build_metric_definitions({"kvtier_config": None, "store_threshold": value})


# ------------------------------------------------------------------ defect 3: the source is named
def test_a_bad_yaml_file_is_named_in_the_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 64GB}\n  - {name: x, backend: memory, "
                    "capacity: 2 blocks, policy: lfu}\n")
    error = _refused(tmp_path, {"kvtier_config": str(path)})
    assert str(error).startswith(f"kvtier_config {path}: 2 problem(s):")
    assert error.source == str(path)
    assert "tiers[0].capacity" in dict(error.problems) and "tiers[1].policy" in dict(error.problems)


def test_an_inline_configs_fields_are_named_under_the_extra_config_key(tmp_path):
    error = _refused(tmp_path, {"kvtier_config": _tiers(tmp_path, store_threshold=-1)})
    [(path, _)] = error.problems
    assert path == "kv_connector_extra_config.kvtier_config.store_threshold"
    assert str(error).startswith("kv_connector_extra_config.kvtier_config.store_threshold: expected ")


# ------------------------------------------------------------------ defect 4: relative paths
def test_a_relative_path_not_found_names_the_directory_and_the_packaged_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    error = _refused(tmp_path, {"kvtier_config": "configs/vllm-cpu-file.yaml"})
    message = str(error)
    assert f"working directory, {tmp_path}" in message
    assert f"kvtier ships a config of that name: give its full path, {PACKAGED / 'vllm-cpu-file.yaml'}" in message


def test_a_relative_path_is_read_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "k.yaml").write_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 2 blocks}\n")
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, {"kvtier_config": "mine/k.yaml"})
    assert spec.hierarchy_config.source == str(tmp_path / "mine" / "k.yaml")


# ------------------------------------------------------------------ defect 5: no warning about the default
def test_the_default_config_draws_no_block_size_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        spec = _spec(tmp_path, {"kvtier_config": None, "block_size": 32})
    assert spec.hierarchy_config.block_tokens == 32
    assert not [r for r in caplog.records if "block_tokens" in r.getMessage()], caplog.text
    with caplog.at_level(logging.WARNING, logger="kvtier"):  # the user's own YAML that disagrees: warned
        _spec(tmp_path, {"kvtier_config": _tiers(tmp_path, block_tokens=256)})
    assert "says block_tokens=256 but vLLM offloads blocks of 32 tokens" in caplog.text
