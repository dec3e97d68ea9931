"""A tier named `engine` is refused: `KVTier.stats()` reports the standalone API's own totals
under "engine", so such a tier's counters were overwritten there and missing from the metrics
endpoint and `kvtier inspect --metrics` (before: accepted)."""

from __future__ import annotations

import pytest

from kvtier import load_config_text
from kvtier.core.errors import ConfigError


def test_a_tier_named_engine_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as info:
        load_config_text("tiers:\n  - {name: engine, backend: memory, capacity: 8 blocks}\n"
                         "  - {name: nvme, backend: memory, capacity: 16 blocks}\n")
    message = str(info.value)
    assert "tiers[0].name" in message and "'engine' is reserved" in message and "choose another name" in message


def test_names_that_only_contain_it_are_fine():
    config = load_config_text("tiers:\n  - {name: engine-cpu, backend: memory, capacity: 8 blocks}\n")
    assert config.tiers[0].name == "engine-cpu"
