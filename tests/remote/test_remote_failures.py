"""RemoteStore when servers pause, die, come back, fill up or refuse: failures are quick
`RemoteUnavailable`s, a breaker turns a dead server off and back on by itself, a dead shard leaves the
others' keys readable, an evicted key is `BlockMissing`, and a password never shows."""

from __future__ import annotations

import logging
import os
import time

import pytest

from kvtier.core.keys import make_offload_key
from kvtier.tiers.remote.errors import BlockMissing, RemoteUnavailable

MARGIN_S = 0.2  # scheduling slack on a busy 2-core machine; one retry would add another 0.25 s


def okey(i: int) -> bytes:
    return make_offload_key(i.to_bytes(16, "big"), 0)


def _timed(fn, *args):
    start = time.perf_counter()
    try:
        fn(*args)
    except RemoteUnavailable as exc:
        return time.perf_counter() - start, exc
    raise AssertionError(f"{fn.__name__} did not raise RemoteUnavailable")


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


def test_paused_server_fails_within_the_timeout_without_retries(private_server, make_store):
    """redis-py retries by default (a paused server made a GET wait its whole retry budget): here one
    GET, one SET and one probe each fail after one timeout, and the store works again after the pause."""
    store = make_store(private_server.url, block_bytes=256 << 10, timeout_s=0.25, breaker_failures=10)
    block = os.urandom(256 << 10)
    store.write_block(okey(1), memoryview(block))
    out = memoryview(bytearray(256 << 10))
    private_server.pause(2000)  # 3 calls x (0.25 s + margin) fit in it
    for call, args in ((store.read_block, (okey(1), out)), (store.probe, ([okey(1)],)),
                       (store.write_block, (okey(2), memoryview(block)))):
        elapsed, exc = _timed(call, *args)
        assert 0.2 <= elapsed <= 0.25 + MARGIN_S, (call.__name__, elapsed)
        assert "timeout" in str(exc).lower()
    _wait(lambda: private_server.client().ping(), 5.0, "unpaused")
    assert store.stats()["timeouts"] == 3 and store.available
    store.read_block(okey(1), out)
    assert bytes(out) == block


def test_killed_server_opens_the_breaker_then_it_closes_by_itself(private_server, make_store):
    store = make_store(private_server.url, block_bytes=4096, breaker_failures=3, breaker_open_s=0.5)
    block = os.urandom(4096)
    store.write_block(okey(1), memoryview(block))
    private_server.kill()
    out = memoryview(bytearray(4096))
    for _ in range(3):
        with pytest.raises(RemoteUnavailable, match="ConnectionError"):
            store.read_block(okey(1), out)
    assert not store.available and store.stats()["breaker_opens"] == 1
    failures = store.stats()["failures"]
    elapsed, exc = _timed(store.probe, [okey(1)])  # refused at once: no socket I/O, no new failure
    assert "circuit breaker open" in str(exc) and elapsed < 0.05
    _timed(store.write_block, okey(2), memoryview(block))
    stats = store.stats()
    assert stats["failures"] == failures and stats["fast_fails"] == 2
    private_server.start()  # same port; its data is gone (no persistence)
    waited = _wait(lambda: store.available, 5.0, "closed")
    assert store.stats()["breaker_closes"] == 1, waited
    with pytest.raises(BlockMissing):
        store.read_block(okey(1), out)
    store.write_block(okey(1), memoryview(block))
    store.read_block(okey(1), out)
    assert bytes(out) == block


def test_a_dead_shard_leaves_the_other_shards_readable(private_cluster, make_store):
    store = make_store(private_cluster.url, block_bytes=4096, breaker_failures=2, breaker_open_s=30)
    blocks = {okey(i): os.urandom(4096) for i in range(30)}
    for key, block in blocks.items():
        store.write_block(key, memoryview(block))
    dead = private_cluster.server_for(store.keys.part_keys(okey(0))[0])
    on_dead = {k for k in blocks if private_cluster.server_for(store.keys.part_keys(k)[0]) is dead}
    assert 0 < len(on_dead) < len(blocks)
    dead.kill()
    private_cluster.wait_failed(dead)  # the live masters mark it failed and go on serving their slots
    assert store.probe(list(blocks)) == [k not in on_dead for k in blocks]  # partial hits
    out = memoryview(bytearray(4096))
    for key, block in blocks.items():
        if key in on_dead:
            with pytest.raises(RemoteUnavailable):
                store.read_block(key, out)
        else:
            store.read_block(key, out)
            assert bytes(out) == block
    assert store.available and store.stats()["breakers_open"] == 1  # only the dead shard's breaker


def test_keys_evicted_by_the_server_are_missing_not_errors(private_server, make_store):
    """64 MiB maxmemory, allkeys-lru: writing 100 blocks of 1 MiB (1.25 MiB each in server memory) keeps
    about 50; every write succeeds, a probe no longer finds the evicted ones and reading one is
    BlockMissing."""
    store = make_store(private_server.url, block_bytes=1 << 20)
    block = os.urandom(1 << 20)
    keys = [okey(i) for i in range(100)]
    for key in keys:
        store.write_block(key, memoryview(block))
    usage = private_server.memory_usage(store.keys.part_keys(keys[-1])[0])
    assert (1 << 20) < usage <= 1.3 * (1 << 20)  # 1,310,768 B with jemalloc 5.3 (value_format.py)
    found = store.probe(keys)
    assert 20 < sum(found) < 64 and found[-1]  # (approximated) LRU: most early blocks are gone
    with pytest.raises(BlockMissing):
        store.read_block(keys[found.index(False)], memoryview(bytearray(1 << 20)))
    out = bytearray(1 << 20)
    store.read_block(keys[-1], memoryview(out))
    assert out == block
    stats = store.stats()
    assert stats["failures"] == 0 and stats["writes"] == 100 and store.available


def test_acl_user_limited_to_its_prefix(valkey_server, make_store, caplog):
    """A tenant's ACL user (`~kvt:tenantA:*`, no dangerous commands) works under its prefix; elsewhere
    the server refuses (NOPERM): RemoteUnavailable, counted as a failure toward the breaker, which then
    stays open (no flapping) until the user is granted the prefix. A wrong password is refused the same
    way. The password shows in no message, repr, stats or log."""
    caplog.set_level(logging.DEBUG)
    secret = "pw-" + os.urandom(8).hex()
    valkey_server.add_acl_user("tenant_a", secret, "kvt:tenantA")
    own = make_store(valkey_server.url, key_prefix="kvt:tenantA", username="tenant_a", password=secret,
                     block_bytes=4096)
    block = os.urandom(4096)
    own.write_block(okey(1), memoryview(block))
    out = memoryview(bytearray(4096))
    own.read_block(okey(1), out)
    assert bytes(out) == block and own.probe([okey(1), okey(2)]) == [True, False]
    messages = [repr(own), str(own.stats()), str(own.options), str(own.options.redacted())]
    other = make_store(valkey_server.url, key_prefix="kvt:tenantB", username="tenant_a", password=secret,
                       block_bytes=4096, breaker_failures=3, breaker_open_s=0.2)
    for call, args in ((other.write_block, (okey(1), memoryview(block))), (other.read_block, (okey(1), out)),
                       (other.probe, ([okey(1)],))):
        _, exc = _timed(call, *args)
        assert "refused" in str(exc) and "NoPermissionError" in str(exc)
        messages.append(str(exc))
    assert other.stats()["refused"] == 3 and not other.available  # K = 3 refusals opened the breaker
    time.sleep(1.0)  # ~5 reconnect checks: each is refused too (an EXISTS in the namespace, not a PING)
    assert not other.available and other.stats()["breaker_closes"] == 0
    valkey_server.client().execute_command("ACL", "SETUSER", "tenant_a", "~kvt:tenantB:*")  # granted
    _wait(lambda: other.available, 5.0, "closed after the grant")
    other.write_block(okey(1), memoryview(block))
    wrong = make_store(valkey_server.url, key_prefix="kvt:tenantA", username="tenant_a", password=secret + "x",
                       block_bytes=4096)
    _, exc = _timed(wrong.read_block, okey(1), out)
    assert "AuthenticationError" in str(exc)
    messages.append(str(exc))
    messages += [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if secret in m]


def test_probes_alone_open_the_breaker_of_a_paused_server(private_server, make_store):
    """A probe's send succeeds on a paused server and only its reply times out: that is one failure,
    not a success followed by a failure, so probes alone open the breaker after K of them."""
    store = make_store(private_server.url, timeout_s=0.25, breaker_failures=2, breaker_open_s=30)
    private_server.pause(2000)
    for _ in range(2):
        elapsed, exc = _timed(store.probe, [okey(1)])
        assert "timeout" in str(exc).lower() and elapsed <= 0.25 + MARGIN_S
    elapsed, exc = _timed(store.probe, [okey(1)])
    assert "circuit breaker open" in str(exc) and elapsed < 0.05
    assert store.stats()["timeouts"] == 2 and not store.available


def test_a_paused_shard_costs_a_cluster_probe_one_timeout(valkey_cluster, make_store):
    """Every shard's probe is sent before any reply is read: with one master paused, a probe of keys
    on all three answers in one timeout, with the other shards' hits."""
    store = make_store(valkey_cluster.url, timeout_s=0.25, breaker_failures=5)
    keys = [okey(i) for i in range(30)]
    for key in keys[::2]:
        store.write_block(key, memoryview(os.urandom(4096)))
    paused = valkey_cluster.server_for(store.keys.part_keys(keys[0])[0])
    on_paused = {k for k in keys if valkey_cluster.server_for(store.keys.part_keys(k)[0]) is paused}
    paused.pause(1000)
    try:
        start = time.perf_counter()
        found = store.probe(keys)
        elapsed = time.perf_counter() - start
    finally:
        _wait(lambda: paused.client().ping(), 5.0, "unpaused")
    assert found == [i % 2 == 0 and k not in on_paused for i, k in enumerate(keys)]
    assert 0.2 <= elapsed <= 0.25 + MARGIN_S
    assert store.stats()["unavailable_keys"] == len(on_paused) and store.stats()["timeouts"] == 1
