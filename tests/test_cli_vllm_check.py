"""`kvtier config check --vllm`: the vLLM connector's own rules (kvtier.config.vllm), without vLLM.
Before, a config whose first tier is `backend: memory` passed, though vLLM refuses it at start."""

from __future__ import annotations

import pytest
from test_config_env import check  # config check FILE FLAGS -> (exit status, stdout, stderr)

from kvtier.config.vllm import require_cpu_first, vllm_hierarchy_config
from kvtier.core.errors import ConfigError
from kvtier.tiers.file import FileBackend
from kvtier.tiers.memory import MemoryBackend

MEMORY_FIRST = "block_tokens: 16\ntiers:\n  - {name: hot, backend: memory, capacity: 8 blocks}\n"


def test_a_first_tier_that_is_not_cpu_is_refused_under_vllm(tmp_path, capsys):
    assert check(tmp_path, MEMORY_FIRST, capsys)[0] == 0  # fine standalone
    code, _, err = check(tmp_path, MEMORY_FIRST, capsys, "--vllm")
    assert code == 2
    assert "tiers[0].backend: under vLLM the first tier must use backend 'cpu'" in err and "got 'memory'" in err


def _cpu_file(tmp_path, head: str = "", file_options: str = "") -> str:
    """A YAML of a 1 MiB cpu tier over a 4 MiB file tier `nvme` in tmp_path/tier."""
    return (f"{head}tiers:\n  - {{name: cpu, backend: cpu, capacity: 1MiB}}\n"
            f"  - {{name: nvme, backend: file, capacity: 4MiB, root_dir: '{tmp_path / 'tier'}'{file_options}}}\n")


def test_what_vllm_decides_is_shown(tmp_path, capsys):
    text = _cpu_file(tmp_path, head="block_tokens: 16\nblock_bytes: 4KiB\n")
    code, out, err = check(tmp_path, text, capsys, "--vllm")
    assert code == 0, err
    assert "shm_name=kvtier-ENGINE_ID-cpu" in out
    assert "the YAML's block_tokens (16) is replaced" in out and "the YAML's block_bytes is ignored" in out
    assert "get the served model and KV layout as their identity" in out
    assert "1MiB per block" not in out  # block_bytes is vLLM's, not the YAML's
    # issue 36.10: it said "capacities in blocks are safest", where docs/vllm.md says byte sizes
    assert "capacities are best written as byte sizes" in out and "in blocks are safest" not in out


def test_a_valkey_tp_in_the_yaml_is_flagged(tmp_path, capsys):
    text = ("tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks}\n"
            "  - {name: shared, backend: valkey, capacity: 8 blocks, url: 'redis://127.0.0.1:1', tp: 2}\n")
    code, out, err = check(tmp_path, text, capsys, "--vllm")
    assert code == 0, err
    assert "the YAML's 2 is refused at start unless it matches" in out


def test_the_path_of_file_tier_loads_is_said(tmp_path, capsys):
    """Issue 38: which path the loads of file-tier blocks take, by connector and option."""
    code, out, err = check(tmp_path, _cpu_file(tmp_path, file_options=", part_checks: 2"), capsys, "--vllm")
    assert code == 0, err
    assert "file tier(s) nvme: under KVTierOffloadingConnector, loaded by each worker process directly" in out
    assert "promoted into the CPU tier and verified there under vLLM's OffloadingConnector" in out
    assert "the file tier's part_checks is the engine's tensor-parallel size; the YAML's 2 is refused" in out


def test_the_connector_refuses_the_same_config_with_the_field_named():
    with pytest.raises(ConfigError) as info:
        require_cpu_first(vllm_hierarchy_config({"tiers": [{"name": "hot", "backend": "memory",
                                                            "capacity": "8 blocks"}]}, block_tokens=16, engine_id="e"))
    assert [p for p, _ in info.value.problems] == ["tiers[0].backend"]


def test_file_tiers_checksum_each_ranks_part_and_a_differing_yaml_value_is_refused(tmp_path):
    """Issue 38: under vLLM a file tier's `part_checks` is the engine's tensor-parallel size, so
    each rank reading the tier directly verifies exactly the bytes it reads."""
    def tiers(**file_options):
        return {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "8 blocks"},
                          {"name": "disk", "backend": "file", "capacity": "8 blocks",
                           "root_dir": str(tmp_path / "disk"), **file_options}]}

    for ranks in (1, 2, 4):
        config = vllm_hierarchy_config(tiers(), block_tokens=16, engine_id="e", ranks=ranks)
        assert config.tiers[1].options["part_checks"] == ranks
    with pytest.raises(ConfigError) as info:
        vllm_hierarchy_config(tiers(part_checks=1), block_tokens=16, engine_id="e", ranks=2, source="x.yaml")
    assert info.value.problems == [("tiers[1].part_checks", "1 in x.yaml, but this engine has 2 tensor-parallel "
                                                            "ranks; leave part_checks out (vLLM's value is used)")]


class KeepingBackend(MemoryBackend):
    """A third party's tier kind whose blocks outlive the engine (`persistent`), named by module path."""

    persistent = True
    OPTIONS = {**MemoryBackend.OPTIONS, "fingerprint": FileBackend.OPTIONS["fingerprint"]}


def test_a_persistent_tier_of_any_kind_gets_the_engines_identity():
    """The identity goes by the backend class's `persistent`, not by the names file and valkey."""
    raw = {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "8 blocks"},
                     {"name": "keep", "backend": f"{__name__}:KeepingBackend", "capacity": "8 blocks",
                      "fingerprint": "rev-7"},
                     {"name": "scratch", "backend": "memory", "capacity": "8 blocks"}]}
    config = vllm_hierarchy_config(raw, block_tokens=16, engine_id="e", fingerprint="model=m;dtype=bf16")
    keep, scratch = config.tiers[1], config.tiers[2]
    assert "rev-7" in keep.options["fingerprint"] and "model=m;dtype=bf16" in keep.options["fingerprint"]
    assert "fingerprint" not in scratch.options


def test_a_list_of_tiers_is_refused_as_the_connector_refuses_it(tmp_path, capsys):
    """Before: --vllm wrapped a top-level list as {tiers: ...} and passed it (exit 0); the plain
    check and the connector refuse it."""
    code, _, err = check(tmp_path, "- {name: cpu, backend: cpu, capacity: 8 blocks}\n", capsys, "--vllm")
    assert code == 2 and "must be a mapping with a 'tiers' list" in err


def test_the_block_size_given_is_checked_under_vllm_too(tmp_path, capsys):
    """Before: --vllm ignored --block-bytes in its checks (2TiB of 1KiB blocks, past the
    policy's 2**30, passed)."""
    code, _, err = check(tmp_path, "tiers:\n  - {name: cpu, backend: cpu, capacity: 2TiB}\n", capsys, "--vllm",
                         "--block-bytes", "1KiB")
    assert code == 2 and "more than policy 'prefix-freq' can hold" in err
