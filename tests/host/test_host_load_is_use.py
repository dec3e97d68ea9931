"""Through the host owner too, a standalone `load` counts as a use of the blocks it loads (the
owner's tiers are touched), as `KVTier.load` does in one process (tests/test_standalone_load_is_use.py)."""

from __future__ import annotations

import pytest
from test_host_standalone import keys, make_kv, model, owner, shared_config  # noqa: F401 (fixtures)

from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")


def test_a_block_loaded_again_through_the_owner_outlives_blocks_never_read(tmp_path, owner, model):  # noqa: F811
    k = keys(5)
    with KVTier.open(shared_config(tmp_path, cpu_blocks=4, file_tier=False), make_kv(), model=model) as tier:
        for i in range(4):
            assert tier.store(k[i:i + 1], [i])
        for _ in range(3):
            assert tier.load(k[:1], [8]) == 1
        assert tier.store(k[4:5], [4])
        held = [i for i in range(5) if tier.lookup(k[i:i + 1]) == 1]
    assert 0 in held and 4 in held and len(held) == 4, held
