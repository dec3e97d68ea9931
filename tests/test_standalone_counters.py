"""`stats()["engine"]` counts blocks, and the metrics' HELP says what each number is (issue 36.11).

On 7e6c7c1 `stores` and `loads` counted copy rounds (2.0 after storing 50 blocks into a 16-block
first tier, whatever the rounds) and every gauge's HELP was `KVTier.stats() <name>`."""

from __future__ import annotations

import dataclasses
import re
import urllib.request

import pytest
from test_standalone import keys, make_kv
from test_standalone_rounds import cpu_file

from kvtier import load_config_text
from kvtier.control.tier import TierStats
from kvtier.standalone import KVTier
from kvtier.standalone.counters import HELP, TransferCounters
from kvtier.standalone.metrics import TIER_HELP

pytest.importorskip("torch")

CPU = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 16 blocks, pin: false}\n")


def test_stores_and_loads_count_blocks_not_calls_or_rounds(tmp_path):
    kv = make_kv(num_blocks=100)
    ks = keys(50)
    with KVTier.open(cpu_file(tmp_path / "nvme", "on_evict"), kv, model="test/counters") as tier:
        assert tier.store(ks, list(range(50)))  # 4 rounds of the 16-block first tier
        assert tier.load(ks, list(range(50, 100))) == 50
        engine = tier.stats()["engine"]
        assert (engine["stores"], engine["loads"]) == (50, 50), engine
        block_bytes = tier.hierarchy.backends["cpu"].block_bytes
        assert engine["store_bytes"] == 50 * block_bytes and engine["load_bytes"] == 50 * block_bytes


def test_every_number_of_stats_has_a_help_text_that_says_what_it_counts():
    tier_numbers = {f.name for f in dataclasses.fields(TierStats)} | {"capacity_blocks", "resident_blocks",
                                                                        "free_blocks"}
    assert tier_numbers <= set(TIER_HELP), sorted(tier_numbers - set(TIER_HELP))
    assert set(TransferCounters().as_dict()) == set(HELP)


def test_the_metrics_help_text_says_what_each_number_counts():
    pytest.importorskip("prometheus_client")
    with KVTier.open(CPU, make_kv(), metrics_port=0) as tier:
        assert tier.store(keys(3), [1, 2, 3])
        with urllib.request.urlopen(tier.metrics_url, timeout=10) as response:
            text = response.read().decode()
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.MULTILINE))
    assert helps["kvtier_engine_stores"] == ("blocks copied from the engine into the hierarchy by KVTier.store "
                                             "(KVTier.stats()[\"engine\"]['stores'])")
    assert helps["kvtier_tier_hits"].startswith("blocks loaded into the engine that this tier supplied")
    assert not [name for name, h in helps.items() if h.startswith("KVTier.stats()")]
