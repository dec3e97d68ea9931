"""`store_threshold` in a shared hierarchy: the owner counts offers host-wide (each `prepare_store`
call of any engine is one offer of its keys), skips the candidates offered fewer times, never
counts an offer asked again after no room, and refuses an engine asking for another threshold."""

from __future__ import annotations

import uuid

import pytest
from host.test_host_owner import client, hex_keys, keys, owner  # noqa: F401  (the owner fixture)
from host.test_host_standalone import keys as engine_keys
from host.test_host_standalone import make_kv, same_blocks

from kvtier import load_config_text
from kvtier.host.client import HostRefused
from kvtier.standalone import KVTier


def hello(threshold=2, cpu_blocks=4, model=None):
    return {"identity": {"model": model or f"m-{uuid.uuid4().hex[:8]}", "block_bytes": 4096, "block_tokens": 16},
            "config": {"store_threshold": threshold,
                       "tiers": [{"name": "cpu", "backend": "cpu", "capacity": f"{cpu_blocks} blocks"}]}}


def test_offers_are_counted_host_wide_and_only_once_per_offer(owner):  # noqa: F811
    greeting = hello()
    a, b = client(owner, greeting), client(owner, greeting)
    first = a.call("prepare_store", keys=hex_keys(keys(2)))
    assert first["store"] == [] and first["skipped"] == 2  # a one-time prompt stays out
    again = a.call("prepare_store", keys=hex_keys(keys(2)), offer=False)  # (the same offer, asked again)
    assert again["store"] == [] and again["skipped"] == 0
    second = b.call("prepare_store", keys=hex_keys(keys(2)))  # another engine's offer: the second
    assert second["store"] == hex_keys(keys(2)) and second["skipped"] == 0
    b.call("complete_store", keys=second["store"], success=True)
    assert a.call("lookup_run", keys=hex_keys(keys(2)))["hits"] == 2


def test_an_engine_asking_for_another_threshold_is_refused(owner):  # noqa: F811
    model = f"m-{uuid.uuid4().hex[:8]}"
    client(owner, hello(2, model=model)).connect()
    with pytest.raises(HostRefused, match=r"store_threshold: .* already has store_threshold=2; "
                                          r"this engine asks for store_threshold=0: give every engine"):
        client(owner, hello(0, model=model)).connect()


def test_a_standalone_engines_skips_are_counted_and_the_second_offer_stored(tmp_path, owner):  # noqa: F811
    config = load_config_text(
        f"store_threshold: 2\nshared: {{scope: host, socket: {owner.socket_path}, timeout_ms: 200}}\n"
        "tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks}\n")
    a_kv, b_kv = make_kv(seed=1), make_kv(seed=9)
    with KVTier.open(config, a_kv, model="m") as a, KVTier.open(config, b_kv, model="m") as b:
        assert a.store(engine_keys(3), [0, 1, 2])  # skipped: not a failure
        assert a.stats()["engine"]["stores_skipped"] == 3 and b.lookup(engine_keys(3)) == 0
        assert a.store(engine_keys(3), [0, 1, 2])
        assert b.load(engine_keys(3), [0, 1, 2]) == 3
        assert same_blocks(a_kv, b_kv, 3)
