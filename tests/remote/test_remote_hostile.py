"""Hostile servers at the store level (issue 27), on a real server behind a loopback proxy
(`tests.support.slow_proxy`): a reply dripped one byte every 20 ms still ends each operation at its
deadline, a slow server opens the breaker, and an ACL user refused GET (but allowed EXISTS) opens it
although its probes succeed. Figures are printed; bounds are generous (3x)."""

from __future__ import annotations

import os
import time

import pytest

from kvtier.tiers.remote.errors import RemoteUnavailable
from tests.support.slow_proxy import SlowProxy

TIMEOUT_S = 0.25
BLOCK = 256


def okey(i: int) -> bytes:
    return b"%032d" % i


@pytest.fixture
def proxy(valkey_server):
    made: list[SlowProxy] = []

    def make(**kwargs) -> SlowProxy:
        made.append(SlowProxy(valkey_server.port, **kwargs).start())
        return made[-1]

    yield make
    for p in made:
        p.stop()


def test_a_dripped_reply_ends_the_read_at_its_deadline(valkey_server, make_store, proxy):
    prefix = f"kvt:drip{os.getpid()}"
    direct = make_store(valkey_server.url, block_bytes=BLOCK, key_prefix=prefix)
    direct.write_block(okey(1), memoryview(os.urandom(BLOCK)))
    slow = make_store(proxy(drip_s=0.02).url, block_bytes=BLOCK, key_prefix=prefix, timeout_s=TIMEOUT_S,
                      connect_timeout_s=TIMEOUT_S, breaker_failures=100)
    out = memoryview(bytearray(BLOCK))
    for _ in range(3):  # (the first also connects through the proxy)
        start = time.monotonic()
        with pytest.raises(RemoteUnavailable, match="TimeoutError"):
            slow.read_block(okey(1), out)
        took = time.monotonic() - start
        print(f"dripped read: gave up after {took * 1000:.0f} ms (deadline {TIMEOUT_S * 1000:.0f} ms)")
        # ~300 bytes at 20 ms each would take 6 s with a timeout per recv
        assert took < 3 * TIMEOUT_S, f"the read took {took:.2f} s past its {TIMEOUT_S} s deadline"
    start = time.monotonic()
    with pytest.raises(RemoteUnavailable):
        slow.probe([okey(i) for i in range(8)], time.monotonic() + TIMEOUT_S)
    assert time.monotonic() - start < 3 * TIMEOUT_S
    start = time.monotonic()
    slow.close()
    assert time.monotonic() - start < 3 * TIMEOUT_S


def test_a_slow_server_opens_the_breaker(valkey_server, make_store, proxy):
    """Every answer comes 200 ms late, inside the 250 ms timeout: no call fails, yet the breaker opens."""
    slow = make_store(proxy(delay_s=0.2).url, block_bytes=BLOCK, timeout_s=TIMEOUT_S, connect_timeout_s=1.0,
                      breaker_failures=3, breaker_open_s=60)
    answered = 0
    for i in range(10):
        try:
            slow.probe([okey(i)])
            answered += 1
        except RemoteUnavailable:
            break
    stats = slow.stats()
    print(f"slow server: {answered} probes answered before the breaker opened; {stats}")
    assert not slow.available and stats["breaker_opens"] == 1 and stats["slow"] >= 3
    assert answered <= 4, "the breaker opened after 3 slow answers"
    with pytest.raises(RemoteUnavailable, match="circuit breaker open"):
        slow.probe([okey(99)])


def test_a_refused_get_opens_the_breaker_although_probes_succeed(private_server, make_store):
    """An ACL user allowed EXISTS but not GET: every probe finds the block, every read is refused.
    The refusals open the breaker (probes do not reset their count), and the reconnect check (which
    GETs too) keeps it open."""
    prefix = "kvt:noget"
    admin = make_store(private_server.url, block_bytes=BLOCK, key_prefix=prefix)
    admin.write_block(okey(1), memoryview(os.urandom(BLOCK)))
    private_server.client().execute_command("ACL", "SETUSER", "noget", "reset", "on", ">pw", f"~{prefix}:*",
                                            "resetchannels", "+@all", "-@dangerous", "-get")
    user = make_store(private_server.url, block_bytes=BLOCK, key_prefix=prefix, username="noget", password="pw",
                      breaker_failures=3, breaker_open_s=0.2)
    out = memoryview(bytearray(BLOCK))
    reads = 0
    for _ in range(10):
        if not user.available:
            break
        assert user.probe([okey(1)]) == [True]
        with pytest.raises(RemoteUnavailable, match="NoPermissionError"):
            user.read_block(okey(1), out)
        reads += 1
    assert reads == 3 and not user.available, f"{reads} refused reads, breaker still closed"
    time.sleep(1.0)  # several reconnect checks are due (every 0.2 s): each is refused its GET
    assert not user.available, "a check that only probes reopened a store whose reads are refused"
    assert user.stats()["refused"] == 3 and user.stats()["breaker_closes"] == 0
