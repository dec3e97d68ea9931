"""RemoteStore on real servers: byte-exact round trips, probes, and every kind of value it must refuse."""

from __future__ import annotations

import os

import pytest

from kvtier.core.keys import make_offload_key
from kvtier.tiers.remote.errors import BlockMissing, ValueRejected


def okey(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(16, "big"), group)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("block_bytes", [64, 4096, 256 << 10, 1 << 20])
def test_round_trip_byte_exact(valkey_server, make_store, tp, block_bytes):
    store = make_store(valkey_server.url, block_bytes=block_bytes, tp=tp)
    blocks = {okey(i, group=i % 2): os.urandom(block_bytes) for i in range(3)}
    for key, block in blocks.items():
        assert store.write_block(key, memoryview(block)) == block_bytes + tp * 44
    for key, block in blocks.items():
        out = bytearray(block_bytes)
        assert store.read_block(key, memoryview(out)) == block_bytes
        assert out == block
    assert store.stats()["reads"] == 3 and store.stats()["failures"] == 0


def test_round_trip_of_a_numpy_block_and_bad_buffers(valkey_server, make_store):
    np = pytest.importorskip("numpy")
    store = make_store(valkey_server.url, block_bytes=4096)
    block = np.arange(1024, dtype=np.float32).reshape(32, 32)
    store.write_block(okey(1), memoryview(block))
    out = np.zeros_like(block)
    store.read_block(okey(1), memoryview(out))
    assert (out == block).all()
    with pytest.raises(ValueError, match="^block: 4095 bytes, expected block_bytes = 4096"):
        store.write_block(okey(2), memoryview(bytes(4095)))
    with pytest.raises(ValueError, match="^out: needs a writable buffer"):
        store.read_block(okey(1), memoryview(bytes(4096)))


def test_missing_and_partial_blocks(valkey_server, make_store):
    store = make_store(valkey_server.url, block_bytes=4096, tp=2)
    out = memoryview(bytearray(4096))
    with pytest.raises(BlockMissing, match="not on the server"):
        store.read_block(okey(7), out)
    store.write_block(okey(8), memoryview(os.urandom(4096)))
    valkey_server.client().delete(store.keys.part_keys(okey(8))[1])  # rank 1 evicted, rank 0 still there
    assert store.probe([okey(8)]) == [False]
    with pytest.raises(BlockMissing):
        store.read_block(okey(8), out)
    assert store.stats()["missing"] == 2 and store.stats()["failures"] == 0 and store.available


def test_probe_single_node(valkey_server, make_store):
    store = make_store(valkey_server.url, block_bytes=64, tp=2)
    present = {okey(i) for i in range(0, 64, 3)}
    for key in present:
        store.write_block(key, memoryview(os.urandom(64)))
    keys = [okey(i) for i in range(64)]
    assert store.probe(keys) == [k in present for k in keys]
    assert store.probe([]) == []


def test_probe_and_round_trip_on_a_cluster(valkey_cluster, make_store):
    store = make_store(valkey_cluster.url, block_bytes=4096, tp=2)
    assert store.stats()["servers"] == 3
    keys = [okey(i) for i in range(64)]
    blocks = {k: os.urandom(4096) for k in keys[::2]}
    for key, block in blocks.items():
        store.write_block(key, memoryview(block))
    holders = {valkey_cluster.server_for(p).port for k in blocks for p in store.keys.part_keys(k)}
    assert len(holders) == 3  # no hash tags: the parts spread over every shard
    assert store.probe(keys) == [k in blocks for k in keys]
    for key, block in blocks.items():
        out = bytearray(4096)
        store.read_block(key, memoryview(out))
        assert out == block


def _copy(server, src: bytes, dst: bytes, transform=lambda v: v) -> None:
    client = server.client()
    client.set(dst, transform(client.get(src)))


def _flip_bit(value: bytes) -> bytes:
    b = bytearray(value)
    b[100] ^= 0x04
    return bytes(b)


@pytest.mark.parametrize("case, words", [
    ("other fingerprint", "another model"), ("other layout", "another model"), ("other tenant", "another key"),
    ("other key", "another key"), ("other rank", "another key"), ("bit flip", "checksum"),
    ("truncated", "truncated"), ("no trailer", "truncated"), ("not a string", "not a string"),
])
def test_foreign_or_damaged_values_are_rejected(valkey_server, make_store, case, words):
    store = make_store(valkey_server.url, block_bytes=4096, tp=2)
    target = store.keys.part_keys(okey(1))[0]
    if case in ("other fingerprint", "other layout", "other tenant"):
        other = make_store(valkey_server.url, block_bytes=4096, tp=2,
                           fingerprint="model:other" if case == "other fingerprint" else "model:abc",
                           layout="L2" if case == "other layout" else "L1",
                           key_prefix=None if case == "other tenant" else store.keys.prefix)
        other.write_block(okey(1), memoryview(os.urandom(4096)))
        store.write_block(okey(1), memoryview(os.urandom(4096)))
        _copy(valkey_server, other.keys.part_keys(okey(1))[0], target)
    else:
        store.write_block(okey(1), memoryview(os.urandom(4096)))
        store.write_block(okey(2), memoryview(os.urandom(4096)))
        source = {"other key": store.keys.part_keys(okey(2))[0], "other rank": store.keys.part_keys(okey(1))[1]}
        transforms = {"bit flip": _flip_bit, "truncated": lambda v: v[:-1], "no trailer": lambda v: v[:2048]}
        if case == "not a string":
            valkey_server.client().delete(target)
            valkey_server.client().rpush(target, b"x")
        else:
            _copy(valkey_server, source.get(case, target), target, transforms.get(case, lambda v: v))
    assert store.probe([okey(1)]) == [True]  # a probe only sees that the keys exist ...
    with pytest.raises(ValueRejected, match=words):  # ... a read verifies and refuses
        store.read_block(okey(1), memoryview(bytearray(4096)))
    stats = store.stats()
    assert stats["rejected"] == 1 and stats["failures"] == 0 and store.available


@pytest.mark.parametrize("spoil", ["longer", "shorter", "empty", "not a string", "missing"])
def test_a_refused_reply_leaves_no_bytes_pending_on_the_connection(valkey_server, make_store, spoil):
    """Values are received straight into the caller's buffer; a reply that is not read to its end
    (a value of another length) closes its connection, so the next read on the store never sees
    the rest of it: each refusal is followed by byte-exact reads of good blocks, many times."""
    store = make_store(valkey_server.url, block_bytes=256 << 10)
    good = os.urandom(256 << 10)
    store.write_block(okey(2), memoryview(good))
    target = store.keys.part_keys(okey(1))[0]
    client = valkey_server.client()
    if spoil == "not a string":
        client.rpush(target, b"x")
    elif spoil != "missing":
        client.set(target, {"longer": os.urandom(3 << 20), "shorter": os.urandom(1000), "empty": b""}[spoil])
    out = memoryview(bytearray(256 << 10))
    for _ in range(5):
        with pytest.raises(BlockMissing if spoil == "missing" else ValueRejected):
            store.read_block(okey(1), out)
        for _ in range(2):
            out[:] = bytes(256 << 10)
            assert store.read_block(okey(2), out) == 256 << 10 and out == good
    stats = store.stats()
    assert stats["failures"] == 0 and stats["reads"] == 10 and store.available
