"""Cluster routing on real clusters: a slot that moves is followed, a cluster that is down when the
store is built is picked up when it comes up, and a TLS cluster (clusters://) works end to end."""

from __future__ import annotations

import os
import time

import pytest
import redis
from remote.servers import Cluster, start_cluster

from kvtier.core.keys import make_offload_key
from kvtier.tiers.remote.errors import RemoteUnavailable


def okey(i: int) -> bytes:
    return make_offload_key(i.to_bytes(16, "big"), 0)


def _node_id(server) -> str:
    return server.client().execute_command("CLUSTER", "MYID").decode()


def moved_slot(cluster, make_store, n: int):
    """A store, and the key `okey(n)` whose first part's slot was just reassigned to another
    master behind the store's back: (store, key, part, slot, new master)."""
    store = make_store(cluster.url, block_bytes=4096, breaker_failures=1)
    key = okey(n)
    part = store.keys.part_keys(key)[0]
    source = cluster.server_for(part)
    target = next(s for s in cluster.servers if s is not source)
    slot = redis.crc.key_slot(part)
    # The new master's config epoch above every other first: gossip the old master sent before its
    # SETSLOT (claiming the slot at its own epoch) then cannot hand the slot back to it on a node
    # that reads that message late (a reassignment a test meant to be settled, undone under load).
    target.client().execute_command("CLUSTER", "BUMPEPOCH")
    for server in [target, source] + [s for s in cluster.servers if s not in (source, target)]:
        server.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(target))
    return store, key, part, slot, target


def test_a_moved_slot_reloads_the_map(valkey_cluster, make_store):
    """The slot of an unwritten key is reassigned to another master: the next write gets MOVED,
    raises RemoteUnavailable (not a breaker failure) and reloads the map; the one after lands on the
    new master and reads back."""
    store, key, part, slot, target = moved_slot(valkey_cluster, make_store, 4242)
    block = os.urandom(4096)
    with pytest.raises(RemoteUnavailable, match="slot moved"):
        store.write_block(key, memoryview(block))
    assert store.stats()["redirects"] == 1 and store.available
    store.write_block(key, memoryview(block))
    assert valkey_cluster.server_for(part) is target and target.client().exists(part) == 1
    out = bytearray(4096)
    store.read_block(key, memoryview(out))
    assert out == block and store.stats()["failures"] == 0


def test_a_moved_reply_routes_the_next_call_even_when_the_reload_fails(valkey_cluster, make_store, monkeypatch):
    """The MOVED reply names the slot's new master: the next write goes there although the reload
    that follows the redirect failed (a seed that timed out under load), and nothing is counted
    against a breaker."""
    store, key, part, slot, target = moved_slot(valkey_cluster, make_store, 4343)
    reloads = []

    def failing_reload() -> None:
        reloads.append(1)
        raise RemoteUnavailable("cluster slot map: TimeoutError: seed did not answer")

    topology = store.servers.topology
    before = topology.node_for(part)
    topology.moved(slot, "?", 6379)  # (a server that does not know its endpoint names none)
    assert topology.node_for(part) is before
    monkeypatch.setattr(topology, "refresh", failing_reload)
    block = os.urandom(4096)
    with pytest.raises(RemoteUnavailable, match="slot moved"):
        store.write_block(key, memoryview(block))
    assert reloads and store.stats()["redirects"] == 1  # (the reconnect thread may have tried too)
    store.write_block(key, memoryview(block))
    assert target.client().exists(part) == 1 and store.stats()["redirects"] == 1
    out = bytearray(4096)
    store.read_block(key, memoryview(out))
    assert out == block and store.stats()["failures"] == 0


def test_a_moved_reply_during_a_reload_outlives_a_map_read_from_a_lagging_node(valkey_cluster, make_store,
                                                                                 monkeypatch):
    """A MOVED reply arrives while a reload is between reading the slot map and applying it, and
    that map came from a node that has not heard of the move yet: the move still routes the next
    call (the reload would otherwise put the old master back)."""
    store, key, part, slot, target = moved_slot(valkey_cluster, make_store, 4545)
    topology = store.servers.topology
    stale = topology.node_for(part).name  # (the old master: what a node that lags still says)
    assert stale != target.name
    real_initialize = redis.cluster.NodesManager.initialize

    def initialize_from_a_lagging_node(client, *args, **kwargs) -> None:
        real_initialize(client, *args, **kwargs)
        host, port = stale.rsplit(":", 1)
        client.slots_cache[slot] = [redis.cluster.ClusterNode(host, int(port))]
        topology.moved(slot, "127.0.0.1", target.port)  # (the MOVED reply, before the map is applied)

    monkeypatch.setattr(redis.cluster.NodesManager, "initialize", initialize_from_a_lagging_node)
    topology.refresh()
    assert topology.node_for(part).name == target.name
    block = os.urandom(4096)
    store.write_block(key, memoryview(block))
    assert target.client().exists(part) == 1 and store.stats()["redirects"] == 0


def test_cluster_down_at_start_is_picked_up_in_the_background(tmp_path, make_store):
    cluster = Cluster(tmp_path / "late")
    store = make_store(cluster.url, block_bytes=4096, breaker_open_s=0.2, wait=False)
    try:
        assert not store.available
        deadline = time.monotonic() + 10
        while "cannot be connected" not in store.reason:  # the load error, once the first load failed
            assert time.monotonic() < deadline, store.reason
            time.sleep(0.02)
        start = time.perf_counter()
        with pytest.raises(RemoteUnavailable, match="slot map not loaded"):
            store.probe([okey(1)])
        assert time.perf_counter() - start < 0.05  # no I/O: the map is not there
        cluster.start()
        deadline = time.monotonic() + 10
        while not store.available:
            assert time.monotonic() < deadline, "the store did not load the slot map"
            time.sleep(0.05)
        block = os.urandom(4096)
        store.write_block(okey(1), memoryview(block))
        out = bytearray(4096)
        store.read_block(okey(1), memoryview(out))
        assert out == block and store.stats()["servers"] == 3
    finally:
        cluster.stop()


def test_tls_cluster(tmp_path, make_store):
    cluster = start_cluster(tmp_path / "tls", tls=True)
    try:
        assert cluster.url.startswith("clusters://")
        store = make_store(cluster.url, block_bytes=4096, tp=2, tls_ca_file=str(cluster.servers[0].tls_ca))
        blocks = {okey(i): os.urandom(4096) for i in range(12)}
        for key, block in blocks.items():
            store.write_block(key, memoryview(block))
        assert store.probe([*blocks, okey(999)]) == [True] * 12 + [False]
        for key, block in blocks.items():
            out = bytearray(4096)
            store.read_block(key, memoryview(out))
            assert out == block
        assert store.stats()["servers"] == 3 and store.stats()["failures"] == 0
    finally:
        cluster.stop()
