"""A standalone `load` counts as a use of the blocks it loads: each tier's policy sees the reuse,
as under vLLM (whose adapter touches a request's hits). Before, nothing in the standalone API
touched a block, so every policy evicted in insertion order: a block loaded again and again left
before blocks never read (`lru`, `prefix-freq`, `arc`, `sieve` alike)."""

from __future__ import annotations

import pytest

from kvtier import load_config_text
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")

from test_standalone import keys, make_kv  # noqa: E402


@pytest.mark.parametrize("policy", ["lru", "prefix-freq", "arc", "sieve"])
def test_a_block_loaded_again_outlives_blocks_never_read(policy):
    config = load_config_text(f"tiers:\n  - {{name: cpu, backend: cpu, capacity: 4 blocks, pin: false, "
                              f"policy: {policy}}}\n")
    k = keys(5)
    with KVTier.open(config, make_kv(), model="test/load-is-use") as tier:
        for i in range(4):  # A, B, C, D, one at a time: A the oldest
            assert tier.store(k[i:i + 1], [i])
        for _ in range(3):
            assert tier.load(k[:1], [8]) == 1  # A, used again and again
        assert tier.store(k[4:5], [4])  # E needs a slot
        held = [i for i in range(5) if tier.lookup(k[i:i + 1]) == 1]
    assert 0 in held and 4 in held and len(held) == 4, held
