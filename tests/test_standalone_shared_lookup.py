"""`KVTier.lookup` over a shared (valkey) tier answers what `load` finds (issue 36, item 11): with
200 blocks on the server and a first tier of 32, `lookup` answered 32 on 7e6c7c1 (what fit in the
first tier) while `load` got all 200."""

from __future__ import annotations

import uuid

import pytest

from kvtier import load_config_text
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")
pytest.importorskip("redis")

from test_nothing_lost import keys, make_kv  # noqa: E402


def _config(url: str, prefix: str):
    return load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: 32 blocks, pin: false}}
  - {{name: shared, backend: valkey, capacity: 1000 blocks, url: '{url}', key_prefix: '{prefix}', timeout_ms: 2000}}
""")


def test_lookup_over_a_shared_tier_counts_what_load_finds(valkey_server):
    prefix = f"kvt:lookup-{uuid.uuid4().hex[:8]}"
    ks = keys(200)
    kv = make_kv(400)
    with KVTier.open(_config(valkey_server.url, prefix), kv, model="test/shared-lookup") as a:
        assert a.store(ks, list(range(200)))
        a.wait()
        assert a.stats()["shared"]["publish_dropped"] == 0
    with KVTier.open(_config(valkey_server.url, prefix), kv, model="test/shared-lookup") as b:
        assert b.lookup(ks) == 200
        assert b.load(ks, list(range(200, 400))) == 200
        for t in kv.tensors:
            assert torch.equal(t.tensor[200:400], t.tensor[:200])
