"""The shared (valkey) tier in a hierarchy on real servers (tests/remote/servers.py: the installed
valkey-server or redis-server): two engines, each with its own CPU tier, share a single node or a
3-master cluster; values evicted or damaged on the server are misses; a paused server is a miss
within the timeout, then at once while the breaker is open; the manager's thread never touches a
socket."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from test_shared_tier import BLOCK, HIT, MISS, RETRY, Engine, content, keys

_prefixes = itertools.count()


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(url: str, options: str = "", **kwargs) -> Engine:
        timeout = "" if "timeout_ms" in options else ", timeout_ms: 2000"  # (a key given twice is refused)
        made.append(Engine(f"{timeout}{options}", url=url, **kwargs))
        store = made[-1].shared.store
        assert store.wait_ready(10), store.reason  # a cluster's slot map loads in the background
        return made[-1]

    make.prefix = f"kvt:tier{next(_prefixes)}-{time.monotonic_ns()}"  # type: ignore[attr-defined]
    yield make
    for engine in made:
        engine.close()


def server_keys(client, prefix: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{prefix}:*"))


@pytest.mark.parametrize("where", ["valkey_server", "valkey_cluster"])
def test_two_engines_share_blocks_byte_identical(where, engines, request):
    target = request.getfixturevalue(where)
    opts = f", key_prefix: '{engines.prefix}'"
    a, b = engines(target.url, opts, hot=16), engines(target.url, opts, hot=16)
    ks = keys(12)
    a.store(ks)
    a.manager.wait_idle(10)
    assert a.stats()["stores"] == 12 and a.stats()["failures"] == 0
    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.settle()
    assert b.manager.lookup_run(ks) == (12, None)
    assert b.load(ks) == [content(k) for k in ks]
    stats = b.stats()
    assert stats["probes"] == 1 and stats["probe_keys"] == 12 and stats["probe_hits"] == 12
    assert b.shared.store.stats()["probes"] == 1, "one probe call for the whole run"
    assert b.manager.lookup(keys(1, 500)[0]) == RETRY
    b.settle()
    assert b.manager.lookup(keys(1, 500)[0]) == MISS


@pytest.mark.parametrize("spoil", ["delete", "flip"])
def test_a_value_gone_or_damaged_on_the_server_is_a_miss(spoil, valkey_server, engines):
    opts = f", key_prefix: '{engines.prefix}'"
    a, b = engines(valkey_server.url, opts), engines(valkey_server.url, opts)
    ks = keys(3, 40)
    a.store(ks)
    a.manager.wait_idle(10)
    client = valkey_server.client()
    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.manager.on_schedule_end()  # the probe is sent; the values are spoiled before they are read
    deadline = time.monotonic() + 10
    while not b.shared.has_probe_results:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    victim = [k for k in server_keys(client, engines.prefix) if k.endswith(ks[1][:-4].hex().encode() + b":0")][0]
    if spoil == "delete":
        client.delete(victim)
    else:
        value = client.get(victim)
        client.set(victim, bytes([value[0] ^ 1]) + value[1:])
    b.settle()
    assert b.manager.lookup_run(ks) == (1, MISS)  # the good blocks were promoted; the bad one is dropped
    assert b.stats()["rejected"] == 1
    b.store([ks[1]], salt=b"recomputed")
    b.manager.wait_idle(10)
    assert client.get(victim)[:BLOCK] == content(ks[1], b"recomputed")


def test_a_paused_server_is_a_miss_within_the_timeout_then_at_once(tmp_path, engines):
    from remote.servers import start_server

    server = start_server(tmp_path / "paused")
    try:
        b = engines(server.url, f", key_prefix: '{engines.prefix}', breaker_failures: 1, breaker_open_s: 30")
        k = keys(1, 900)[0]
        server.pause(3000)
        started = time.monotonic()
        assert b.manager.lookup(k) == RETRY
        b.manager.on_schedule_end()
        while b.manager.lookup(k) == RETRY:
            time.sleep(0.005)
            b.manager.on_schedule_end()
        waited = time.monotonic() - started
        assert waited < 2.0 + 1.0, f"answered after {waited:.2f} s (timeout 2 s)"
        while b.stats()["probe_failures"] + b.stats()["probe_timeouts"] == 0 or b.shared.available:
            assert time.monotonic() - started < 5, "the failed probe never opened the breaker"
            b.manager.on_schedule_end()
            time.sleep(0.005)
        assert b.manager.lookup(keys(1, 901)[0]) == MISS, "breaker open: MISS at once"
        assert not b.manager.has_pending_work()
    finally:
        server.stop()


def test_no_manager_call_does_socket_io_on_its_thread(valkey_server, engines, monkeypatch):
    import socket

    opts = f", key_prefix: '{engines.prefix}'"
    a, b = engines(valkey_server.url, opts), engines(valkey_server.url, opts)
    me = threading.get_ident()
    calls: list[str] = []
    for name in ("connect", "connect_ex", "send", "sendall", "sendmsg", "recv", "recv_into", "recvfrom"):
        original = getattr(socket.socket, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            if threading.get_ident() == me:
                calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(socket.socket, name, spy)
    ks = keys(5, 70)
    a.store(ks)
    a.settle()
    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.settle()
    assert b.manager.lookup_run(ks) == (5, None)
    assert b.load(ks) == [content(k) for k in ks]
    assert [b.manager.lookup(k) for k in ks] == [HIT] * 5
    assert calls == [], f"socket calls on the manager's thread: {calls}"
    monkeypatch.undo()
    assert valkey_server.client().ping()


def test_an_acl_user_publishes_under_its_prefix_only(valkey_server, engines, monkeypatch):
    """A tenant's ACL user (`~{prefix}:*`), its password from the environment: its engine publishes
    and another engine of the tenant finds the blocks; configured with another tenant's prefix the
    server refuses it, and that is a dropped publish, never an error of the engine."""
    prefix = engines.prefix
    valkey_server.add_acl_user("tenant-a", "pw-of-tenant-a", prefix)
    monkeypatch.setenv("KVT_TENANT_PW", "pw-of-tenant-a")
    opts = f", key_prefix: '{prefix}', username: tenant-a, password_env: KVT_TENANT_PW"
    a, b = engines(valkey_server.url, opts), engines(valkey_server.url, opts)
    ks = keys(2, 600)
    a.store(ks)
    a.manager.wait_idle(10)
    assert a.stats()["stores"] == 2 and a.stats()["failures"] == 0
    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.settle()
    assert b.manager.lookup_run(ks) == (2, None) and b.load(ks) == [content(k) for k in ks]
    other = engines(valkey_server.url, f", key_prefix: '{prefix}-other', username: tenant-a, "
                                       f"password_env: KVT_TENANT_PW")
    other.store(ks)
    other.manager.wait_idle(10)
    assert other.stats()["stores"] == 0 and other.stats()["publish_dropped"] == 2, "refused writes are dropped"
    assert other.manager.get_stats()["hot"]["resident_blocks"] == 2, "the engine's own tier is unaffected"


def test_bench_hops_measures_cpu_remote_against_the_raw_client(valkey_server):
    """`kvtier bench hops` rows for a valkey tier: both hops and their same-run raw baselines,
    the blocks loaded back byte-identical (checked inside the measurement)."""
    from kvtier.bench.hops_runner import remote_rows
    from kvtier.config import load_config_text

    config = load_config_text(f"""
tiers:
  - {{name: cpu, backend: memory, capacity: 8 blocks}}
  - {{name: shared, backend: valkey, capacity: 64 blocks, url: '{valkey_server.url}', timeout_ms: 2000,
      threads: 2}}
""")
    rows = remote_rows(config, [64 << 10], 1 << 20, None)
    assert [r["hop"] for r in rows] == ["CPU->REMOTE", "REMOTE->CPU"]
    for row in rows:
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0 and row["block_bytes"] == 64 << 10
        assert row["threads"] == 2 and row["url"] == valkey_server.url and row["paired_ratio"] > 0


def test_a_dead_cluster_shard_leaves_partial_hits(tmp_path, engines):
    """One of three masters killed: the blocks on the live shards are still found and served
    byte-identical, those on the dead one are misses; every lookup settles, nothing raises."""
    from remote.servers import start_cluster

    cluster = start_cluster(tmp_path / "cluster")
    try:
        opts = f", key_prefix: '{engines.prefix}', timeout_ms: 500, breaker_failures: 2"
        a, b = engines(cluster.url, opts, hot=16), engines(cluster.url, opts, hot=16)
        ks = keys(12, 300)
        a.store(ks)
        a.manager.wait_idle(10)
        assert a.stats()["stores"] == 12
        shard_of = {k: cluster.server_for(b.shared.store.keys.part_keys(k)[0]).port for k in ks}
        dead = next(s for s in cluster.servers if s.port in set(shard_of.values()))
        dead.kill()
        cluster.wait_failed(dead)
        answers = {}
        for key in ks:  # key by key: a run would stop at the first miss
            deadline = time.monotonic() + 15
            while (answer := b.manager.lookup(key)) is RETRY:
                assert time.monotonic() < deadline, "a lookup kept answering RETRY"
                b.manager.on_schedule_end()
                b.manager.wait_idle(10)
                time.sleep(0.01)
            answers[key] = answer
        on_dead = {k for k in ks if shard_of[k] == dead.port}
        assert {k for k, a in answers.items() if a is HIT} == set(ks) - on_dead
        assert {k for k, a in answers.items() if a is MISS} == on_dead
        served = [k for k in ks if k not in on_dead]
        assert b.load(served) == [content(k) for k in served]
    finally:
        cluster.stop()


def test_tp2_blocks_are_one_value_per_rank_and_a_missing_rank_is_a_miss(valkey_server, engines):
    """A tier with tp: 2 (a TP=2 engine's: the CPU slot holds rank r's bytes at [r*P, (r+1)*P)) writes
    `0of2` and `1of2` values, each carrying its rank's half; another TP=2 engine loads the blocks
    byte-identical from both; a block with one rank's value gone is a miss, never served; a TP=1
    tier of the same model and prefix finds none of them."""
    opts = f", key_prefix: '{engines.prefix}', tp: 2"
    a, b = engines(valkey_server.url, opts), engines(valkey_server.url, opts)
    assert a.shared.tp == 2
    ks = keys(4, 700)
    a.store(ks)
    a.manager.wait_idle(10)
    assert a.stats()["stores"] == 4 and a.stats()["failures"] == 0
    client = valkey_server.client()
    stored = server_keys(client, engines.prefix)
    assert len(stored) == 8
    half = BLOCK // 2
    for key in ks:
        tail = b":%s:0" % key[:-4].hex().encode()
        parts = sorted(k for k in stored if k.endswith(tail))
        assert [p.split(b":")[-3] for p in parts] == [b"0of2", b"1of2"]
        for rank, part in enumerate(parts):
            assert client.get(part)[:half] == content(key)[rank * half:(rank + 1) * half]
    victim = [k for k in stored if k.endswith(b":1of2:%s:0" % ks[2][:-4].hex().encode())]
    assert len(victim) == 1
    client.delete(victim[0])

    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.settle()
    assert b.manager.lookup_run(ks) == (2, MISS)
    assert b.load(ks[:2]) == [content(k) for k in ks[:2]]
    assert b.manager.lookup(ks[3]) == HIT and b.load(ks[3:]) == [content(ks[3])]
    assert b.manager.lookup(ks[2]) == MISS

    one = engines(valkey_server.url, f", key_prefix: '{engines.prefix}'")
    assert one.manager.lookup_run(ks) == (0, RETRY)
    one.settle()
    assert one.manager.lookup_run(ks) == (0, MISS) and one.stats()["probe_hits"] == 0


def test_tp2_a_rank_value_gone_after_the_probe_is_a_miss(valkey_server, engines):
    """The probe found both ranks; one is deleted before the promotion reads it: the block is
    recomputed (MISS), never served half-filled."""
    opts = f", key_prefix: '{engines.prefix}', tp: 2"
    a, b = engines(valkey_server.url, opts), engines(valkey_server.url, opts)
    ks = keys(2, 800)
    a.store(ks)
    a.manager.wait_idle(10)
    client = valkey_server.client()
    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.manager.on_schedule_end()
    deadline = time.monotonic() + 10
    while not b.shared.has_probe_results:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    client.delete(b"%s:%s:1of2:%s:0" % (engines.prefix.encode(), b.shared.store.keys.tag.encode(),
                                       ks[0][:-4].hex().encode()))
    b.settle()
    assert b.manager.lookup_run(ks) == (0, MISS)
    assert b.stats()["rejected"] == 1
    assert b.manager.lookup(ks[1]) in (HIT, RETRY)  # read fine; promoted again if in the failed job
    b.settle()
    assert b.manager.lookup(ks[1]) == HIT and b.load(ks[1:]) == [content(ks[1])]
