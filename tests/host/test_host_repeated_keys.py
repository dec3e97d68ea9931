"""Through the host owner's socket (another engine on the host is untrusted), a store naming a
key twice takes one slot of the shared tier: a client repeating keys cannot shrink the tier
every engine shares."""

from __future__ import annotations

import pytest
from test_host_standalone import keys, make_kv, model, owner, shared_config  # noqa: F401 (fixtures)

from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")


def test_each_key_sent_twice_still_fills_every_slot(tmp_path, owner, model):  # noqa: F811
    with KVTier.open(shared_config(tmp_path, cpu_blocks=8, file_tier=False), make_kv(), model=model) as tier:
        for key in keys(8):
            answer = tier.client.call("prepare_store", keys=[key.hex(), key.hex()])
            assert answer["room"], answer
            assert answer["store"] == [key.hex()] and len(answer["slots"]) == 1, answer
            tier.client.call("complete_store", keys=[key.hex(), key.hex()], success=True)
        assert tier.lookup(keys(8)) == 8
        assert tier.stats()["cpu"]["resident_blocks"] == 8
