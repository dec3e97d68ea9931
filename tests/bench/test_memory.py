"""The index-memory benchmark (issue 19: <= 100 bytes per resident block, key included)."""

from __future__ import annotations

import json

from benchmarks import memory
from kvtier.core.types import BlockStatus
from kvtier.policies.lru_compiled import LRUCachePolicy
from kvtier.policies.prefix_compiled import PrefixFreqCachePolicy


def test_compact_index_allocates_under_100_bytes_per_block_at_1m_and_8m():
    """What the arrays allocate for a full tier of 36-byte keys (RSS is the benchmark's figure;
    this is its deterministic part), at both sizes of the issue."""
    for cls in (LRUCachePolicy, PrefixFreqCachePolicy):
        for n in (1_000_000, 8_000_000):
            policy = cls(n)
            policy.insert(b"k" * 36, BlockStatus(0))
            assert policy.memory_bytes() / n <= 100, f"{cls.__name__}: {policy.memory_bytes() / n:.1f} B/block at {n}"


def test_rows_give_rss_growth_per_block_in_fresh_processes(tmp_path):
    out = tmp_path / "memory.json"
    assert memory.main(["--blocks", "60000", "--policies", "lru-py,lru", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kvtier.bench.memory/1" and doc["key_bytes"] == 36
    assert {"created", "commit", "machine", "versions"} <= set(doc)
    lru, compact = doc["rows"]
    assert (lru["policy"], compact["policy"]) == ("lru-py", "lru")  # pure Python, compiled
    for row in (lru, compact):
        assert row["blocks"] == 60000 and row["rss_after"] > row["rss_before"]
        assert row["bytes_per_block"] == round((row["rss_after"] - row["rss_before"]) / 60000, 1)
    # PureLRUCachePolicy holds a key object, a block object and a dict entry per block; the index only bytes
    assert compact["bytes_per_block"] < lru["bytes_per_block"] / 2
    assert compact["allocated_bytes_per_block"] <= 100


def test_churn_reports_the_memory_of_evicted_blocks_history(tmp_path):
    """With --churn the tier is refilled with new blocks, evicting as many: prefix-freq then
    holds ghosts (evicted keys) and lru none, and the row says so beside the growth after it."""
    out = tmp_path / "memory.json"
    assert memory.main(["--blocks", "20000", "--churn", "2", "--policies", "lru,prefix-freq", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    lru, prefix = doc["rows"]
    assert doc["churn"] == 2 and lru["churned_blocks"] == prefix["churned_blocks"] == 40000
    assert lru["ghosts"] == 0 and prefix["ghosts"] == 40000  # 6 capacities at most, all 40000 evicted here
    assert prefix["bytes_per_block_after_churn"] > prefix["bytes_per_block"]
