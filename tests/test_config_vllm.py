"""The vLLM connector's `kvtier_config` (a YAML path or an inline mapping) is read under the same
limits as any config: an alias bomb or a huge file is one ConfigError naming the field, at once."""

from __future__ import annotations

import importlib.util
import time

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

TIER = {"name": "cpu", "backend": "cpu", "capacity": "2 blocks"}


def shared_bomb(levels: int = 9) -> list:
    """A list whose expansion holds 9**levels values, built from a few hundred shared objects."""
    value: list = ["x"] * 9
    for _ in range(levels - 1):
        value = [value] * 9
    return value


def test_inline_mapping_with_a_shared_bomb_under_an_unknown_key_is_refused_at_once():
    from kvtier.core.errors import ConfigError
    from kvtier.integrations.vllm import load_raw_config, vllm_hierarchy_config

    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        raw, source = load_raw_config({"tiers": [TIER], "x-junk": shared_bomb()})
        vllm_hierarchy_config(raw, block_tokens=16, engine_id="e", source=source)
    assert time.perf_counter() - started < 2
    [(path, message)] = info.value.problems
    assert path.startswith("x-junk") and "more than 10000 values" in message


def test_yaml_file_with_an_alias_bomb_or_over_the_size_limit_is_refused(tmp_path):
    from kvtier.core.errors import ConfigError
    from kvtier.integrations.vllm import load_raw_config

    bomb = tmp_path / "bomb.yaml"
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    bomb.write_text("\n".join(lines) + "\ntiers: [{name: cpu, backend: cpu, capacity: 2 blocks}]\nx-junk: *i\n")
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_raw_config(str(bomb))
    assert time.perf_counter() - started < 2
    assert "x-junk" in [p for p, _ in info.value.problems]
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError) as info:
        load_raw_config(str(big))
    [(path, message)] = info.value.problems
    assert path == "kvtier_config" and "the limit is 1 MiB" in message
