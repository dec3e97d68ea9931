"""The other URL forms on real servers (TLS, Unix socket) and one store shared by many threads."""

from __future__ import annotations

import os
import threading

import pytest
from remote.servers import start_server, start_tls_server

from kvtier.core.keys import make_offload_key
from kvtier.tiers.remote.errors import BlockMissing, RemoteUnavailable


def okey(i: int) -> bytes:
    return make_offload_key(i.to_bytes(16, "big"), 0)


def _round_trip(store, n: int = 3) -> None:
    blocks = {okey(i): os.urandom(store.block_bytes) for i in range(n)}
    for key, block in blocks.items():
        store.write_block(key, memoryview(block))
    assert store.probe(list(blocks) + [okey(99)]) == [True] * n + [False]
    for key, block in blocks.items():
        out = bytearray(store.block_bytes)
        store.read_block(key, memoryview(out))
        assert out == block


@pytest.fixture
def tls_server(tmp_path):
    server = start_tls_server(tmp_path / "tls")
    yield server
    server.stop()


def test_tls_round_trip_verified_by_the_ca(tls_server, make_store):
    assert tls_server.url.startswith("rediss://")
    store = make_store(tls_server.url, tls_ca_file=str(tls_server.tls_ca), block_bytes=64 << 10)
    _round_trip(store)
    with pytest.raises(BlockMissing):  # over TLS the client speaks RESP3: a missing key is '_', not '$-1'
        store.read_block(okey(99), memoryview(bytearray(64 << 10)))
    _round_trip(store)


def test_tls_without_verification_and_an_unknown_ca(tls_server, make_store):
    _round_trip(make_store(tls_server.url, tls_verify=False))
    untrusted = make_store(tls_server.url)  # the system's CAs do not know the test CA
    with pytest.raises(RemoteUnavailable, match="certificate verify failed"):
        untrusted.read_block(okey(0), memoryview(bytearray(4096)))


def test_plain_client_on_a_tls_port_fails_within_the_timeout(tls_server, make_store):
    plain = make_store(tls_server.url.replace("rediss://", "redis://"), timeout_s=0.25)
    with pytest.raises(RemoteUnavailable):
        plain.probe([okey(0)])


def test_unix_socket(tmp_path, make_store):
    sock = tmp_path / "v.sock"
    server = start_server(tmp_path / "unix", ["--unixsocket", str(sock), "--unixsocketperm", "700"])
    try:
        _round_trip(make_store(f"unix://{sock}", block_bytes=64 << 10))
    finally:
        server.stop()


def test_one_store_many_threads(valkey_server, make_store):
    """Writers and readers on one store at once: every read is byte-exact (no connection is shared
    between two commands in flight, no reply goes to the wrong caller)."""
    store = make_store(valkey_server.url, block_bytes=32 << 10, tp=2)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(20):
                key = okey(t * 1000 + i)
                block = bytes([t, i]) * (16 << 10)
                store.write_block(key, memoryview(block))
                assert store.probe([key, okey(t * 1000 + 999)]) == [True, False]
                out = bytearray(32 << 10)
                store.read_block(key, memoryview(out))
                assert out == block
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert store.stats()["reads"] == 120 and store.stats()["failures"] == 0
