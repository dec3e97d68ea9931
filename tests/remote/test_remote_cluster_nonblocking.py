"""The scheduler thread never waits on cluster I/O: a slot-map reload that hangs does not hold up
`available` / `nodes()`, building a store on hung seeds does no I/O on the caller's thread, close
does not wait for the hung reload, and a map that cannot load says why (a WARNING once, `reason`)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.store import RemoteStore


@pytest.fixture
def silent_seeds():
    """Three listeners that accept connections and never answer (hung hosts)."""
    socks, conns = [], []
    for _ in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        socks.append(s)

    def accept(s: socket.socket) -> None:
        while True:
            try:
                conns.append(s.accept()[0])
            except OSError:
                return

    for s in socks:
        threading.Thread(target=accept, args=(s,), daemon=True).start()
    yield "cluster://" + ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
    for s in socks + conns:
        s.close()


def test_a_hung_reload_does_not_block_available(valkey_cluster, make_store, monkeypatch):
    from redis.cluster import NodesManager

    store = make_store(valkey_cluster.url, block_bytes=4096)
    topology = store.servers.topology
    assert store.available
    release = threading.Event()
    monkeypatch.setattr(NodesManager, "initialize", lambda self: release.wait(5))  # seeds that do not answer
    reload = threading.Thread(target=topology.refresh)
    reload.start()
    try:
        time.sleep(0.2)
        assert reload.is_alive()
        start = time.perf_counter()
        for _ in range(100):
            assert store.available
            assert len(topology.nodes()) == 3
        assert time.perf_counter() - start < 0.1
    finally:
        release.set()
        reload.join()


def test_building_and_closing_on_hung_seeds_do_no_io_on_the_callers_thread(silent_seeds, caplog):
    options = ClientOptions(silent_seeds, timeout_s=0.5, connect_timeout_s=0.5)
    start = time.perf_counter()
    store = RemoteStore(options, key_prefix="kvt:hung", fingerprint="m", layout="L", block_bytes=4096)
    built = time.perf_counter() - start
    try:
        assert built < 0.2, f"building took {built:.2f} s"
        assert not store.available
        assert "not loaded yet" in store.reason
    finally:
        time.sleep(0.1)  # the reconnect thread is now in its reload, hung on the first seed
        start = time.perf_counter()
        store.close()
        closed = time.perf_counter() - start
    assert closed < 0.2, f"close took {closed:.2f} s"


def test_a_non_cluster_server_warns_once_with_the_reason(valkey_server, caplog):
    url = "cluster://" + valkey_server.name
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.remote.topology")
    store = RemoteStore(ClientOptions(url, breaker_open_s=0.1), key_prefix="kvt:nc", fingerprint="m",
                        layout="L", block_bytes=4096)
    try:
        deadline = time.monotonic() + 10
        while not store.servers.topology.reason:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.5)  # several more failed reloads (one every breaker_open_s)
        assert not store.available
        assert "cluster" in store.reason.lower() and store.reason != "cluster slot map not loaded yet"
        warnings = [r for r in caplog.records if "cluster slot map" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        assert store.servers.topology.reason in warnings[0].getMessage()
    finally:
        store.close()


def test_the_map_loads_while_the_first_seed_hangs(private_cluster, make_store):
    """The first seed is SIGSTOPped (accepts, never answers): the map is read from the next seed and
    the live shards serve their keys."""
    import os
    import signal

    hung = private_cluster.servers[0]
    os.kill(hung.proc.pid, signal.SIGSTOP)
    try:
        store = make_store(private_cluster.url, block_bytes=4096, wait=False, timeout_s=0.3,
                           connect_timeout_s=0.3, breaker_open_s=0.2)
        assert store.wait_ready(10), store.reason
        key = next(k for k in (bytes([i]) * 16 for i in range(256))
                   if store.servers.topology.node_for(store.keys.part_keys(k)[0]).name != hung.name)
        store.write_block(key, memoryview(bytes(4096)))
        assert store.probe([key]) == [True]
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
