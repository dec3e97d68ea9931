"""A call the engine gave up on (no answer within `timeout_ms`) costs a miss or a skipped store and
nothing more: what the owner did for it once it ran again (slots reserved for a store, pins of a
load) is undone at once, not kept until the engine disconnects (+ the 30 s grace).

Before: a store that timed out while the owner hung left its keys "being written" forever, so the
same engine's next store of them stored nothing, other engines' lookups and loads waited 5 s and
found nothing, and a few such hiccups filled the CPU tier (every engine's store then took 5 s and
failed); a load that timed out left its blocks pinned (never evictable)."""

from __future__ import annotations

import time
import uuid

import pytest
from host.owner_process import OwnerProcess
from host.test_host_owner import client, hello, hex_keys, keys, owner, raw_connection  # noqa: F401  (fixture)
from host.test_host_standalone import TIMEOUT_MS, make_kv, same_blocks, wipe
from host.test_host_standalone import keys as engine_keys

from kvtier import load_config_text
from kvtier.host.wire import FrameReader, HostUnavailable, encode, read_frame
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")

FAST_S = 1.0  # far below the 5 s a call waited for stores that were never completed


@pytest.fixture
def model():
    return f"test-model-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def process_owner(tmp_path):
    proc = OwnerProcess(f"{tmp_path}/run/host.sock", tmp_path / "owner.log").start()
    yield proc
    proc.stop()


def _engines(tmp_path, model):
    """Engines a and b on one 16-block LRU CPU tier (rounds of 4 keys); b retries at once after a failure."""
    config = load_config_text(f"""
shared: {{scope: host, socket: {tmp_path}/run/host.sock, timeout_ms: {TIMEOUT_MS}}}
tiers:
  - {{name: cpu, backend: cpu, capacity: 16 blocks, policy: lru}}
""")
    a_kv, b_kv = make_kv(seed=1), make_kv(seed=9)
    a, b = KVTier.open(config, a_kv, model=model), KVTier.open(config, b_kv, model=model)
    b.client.backoff_s = 0.0  # (no 1 s pause after the timeouts: the test stays short)
    return a, a_kv, b, b_kv


def _while_paused(owner_process, call):
    owner_process.pause()
    try:
        return call()
    finally:
        owner_process.resume()


def test_a_store_that_timed_out_while_the_owner_hung_is_stored_by_the_next_store(tmp_path, process_owner, model):
    a, a_kv, b, b_kv = _engines(tmp_path, model)
    with a, b:
        assert _while_paused(process_owner, lambda: b.store(engine_keys(4), list(range(4)))) is False
        start = time.monotonic()
        assert b.store(engine_keys(4), list(range(4)))  # (before: True, storing nothing)
        wipe(a_kv)
        assert a.lookup(engine_keys(4)) == 4
        assert a.load(engine_keys(4), list(range(4))) == 4
        assert time.monotonic() - start < FAST_S
        assert same_blocks(a_kv, b_kv, 4)


def test_stores_that_timed_out_never_fill_the_cpu_tier(tmp_path, process_owner, model):
    a, a_kv, b, _ = _engines(tmp_path, model)
    with a, b:
        # Four rounds of 4 keys, each timing out: before, 16 never-completed stores in a 16-block tier.
        assert _while_paused(process_owner, lambda: b.store(engine_keys(16), list(range(16)))) is False
        assert b.lookup(engine_keys(1, start=999)) == 0  # (b's connection: the owner is past b's cancels)
        start = time.monotonic()
        assert a.store(engine_keys(16, start=100), list(range(16)))
        a_copy = [t.tensor[:16].clone() for t in a_kv.tensors]
        wipe(a_kv)
        assert a.load(engine_keys(16, start=100), list(range(16))) == 16
        assert time.monotonic() - start < FAST_S
        assert all(torch.equal(t.tensor[:16], c) for t, c in zip(a_kv.tensors, a_copy))


def test_a_load_that_timed_out_while_the_owner_hung_leaves_no_pins(tmp_path, process_owner, model):
    a, a_kv, b, _ = _engines(tmp_path, model)
    with a, b:
        assert a.store(engine_keys(4), list(range(4)))
        assert _while_paused(process_owner, lambda: b.load(engine_keys(4), list(range(4)))) == 0
        assert b.lookup(engine_keys(4)) == 4  # (b's connection: the owner is past b's cancel)
        start = time.monotonic()
        # 16 other blocks all stay in the 16-block tier only if the 4 loaded blocks (the least recent)
        # are evictable again; before, they stayed pinned and 4 of the new ones were evicted instead.
        assert a.store(engine_keys(16, start=100), list(range(16)))
        assert time.monotonic() - start < FAST_S
        assert a.lookup(engine_keys(16, start=100)) == 16
        assert a.lookup(engine_keys(4)) == 0


# ---------------------------------------------------------------- the protocol, in-process owner
def test_the_owner_undoes_a_prepare_store_the_client_gave_up_on(owner):  # noqa: F811
    greeting = hello(cpu_blocks=4)
    a, b = client(owner, greeting, timeout_ms=100), client(owner, greeting)
    a.backoff_s = 0.0
    a.connect()
    (namespace,) = owner.namespaces.values()
    with namespace.lock:  # (the owner cannot answer: the call times out)
        with pytest.raises(HostUnavailable, match="timeout_ms"):
            a.call("prepare_store", keys=hex_keys(keys(4)))
    assert a.call("lookup_run", keys=hex_keys(keys(4)))["hits"] == 0  # (a's late answer is skipped)
    again = a.call("prepare_store", keys=hex_keys(keys(4)))
    assert again["room"] is True and again["store"] == hex_keys(keys(4))  # its slots were freed
    assert b.call("prepare_store", keys=hex_keys(keys(4, start=10)))["room"] is False  # (a holds them now)


def test_the_owner_releases_the_pins_of_a_prepare_load_the_client_gave_up_on(owner):  # noqa: F811
    greeting = hello(cpu_blocks=4)
    a = client(owner, greeting, timeout_ms=100)
    a.backoff_s = 0.0
    a.call("complete_store", keys=a.call("prepare_store", keys=hex_keys(keys(2)))["store"], success=True)
    (namespace,) = owner.namespaces.values()
    with namespace.lock:
        with pytest.raises(HostUnavailable, match="timeout_ms"):
            a.call("prepare_load", keys=hex_keys(keys(2)))
    assert a.call("lookup_run", keys=hex_keys(keys(2)))["hits"] == 2
    table = namespace.manager.tiers[0].table
    assert [table.get(key).ref_cnt for key in keys(2)] == [0, 0]


def test_only_the_last_answered_request_can_be_cancelled(owner):  # noqa: F811
    sock, reader = raw_connection(owner), FrameReader()

    def ask(message):
        sock.sendall(encode(message))
        return read_frame(sock, reader)

    ask({"id": 1, "op": "hello", **hello(cpu_blocks=4)})
    assert ask({"id": 2, "op": "prepare_store", "keys": hex_keys(keys(2))})["store"] == hex_keys(keys(2))
    ask({"id": 3, "op": "lookup_run", "keys": []})
    assert ask({"id": 4, "op": "cancel", "of": 2})["cancelled"] == 0  # (not the last one: kept)
    assert ask({"id": 5, "op": "complete_store", "keys": hex_keys(keys(2)), "success": True})["completed"] == 2
    pinned = ask({"id": 6, "op": "prepare_load", "keys": hex_keys(keys(2))})["slots"]
    assert len(pinned) == 2
    assert ask({"id": 7, "op": "cancel", "of": 6})["cancelled"] == 2
    assert ask({"id": 8, "op": "cancel", "of": 6})["cancelled"] == 0  # (once)
    assert ask({"id": 9, "op": "complete_load", "keys": hex_keys(keys(2))})["released"] == 0
    sock.close()
