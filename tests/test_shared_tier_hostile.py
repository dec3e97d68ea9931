"""The shared tier against hostile servers (issue 27 items 1, 2; issue 26 item 8), on a real server
behind a loopback proxy (`tests.support.slow_proxy`): every lookup is answered within one step plus
`timeout_ms` whatever the server does, `close()` is bounded, probe work stays bounded against a slow
server (which opens the breaker), and the first failure logs one WARNING with its cause. Loops are
bounded in count and time; measured figures are printed, bounds are generous (3x)."""

from __future__ import annotations

import logging
import time

import pytest
from test_shared_tier import MISS, RETRY, Engine, keys

from kvtier.testing.fake_remote import FakeServer, fake_valkey
from kvtier.tiers.remote.runtime import MAX_QUEUED
from tests.support.slow_proxy import SlowProxy

TIMEOUT_S = 0.25
STEP_S = 0.01


@pytest.fixture
def hostile(valkey_server):
    """`hostile(**proxy_kwargs)`: (a publishing engine straight on the server, an engine behind a
    proxy) with one key prefix; both closed at teardown (unless the test closed them)."""
    made: list = []
    prefix = f"kvt:hostile{time.monotonic_ns()}"

    def make(options: str = "", hot: int = 8, **proxy_kwargs) -> tuple[Engine, Engine]:
        proxy = SlowProxy(valkey_server.port, **proxy_kwargs).start()
        made.append(proxy)
        direct = Engine(f", timeout_ms: 2000, key_prefix: '{prefix}'", url=valkey_server.url, hot=hot)
        made.append(direct)
        slow = Engine(f", timeout_ms: {int(TIMEOUT_S * 1000)}, key_prefix: '{prefix}'{options}", url=proxy.url,
                      hot=hot)
        made.append(slow)
        return direct, slow

    yield make
    for thing in reversed(made):
        thing.stop() if isinstance(thing, SlowProxy) else thing.close()


def drive(engine: Engine, ks: list[bytes], limit_s: float) -> dict[bytes, tuple[object, float]]:
    """Look every key of `ks` up each step (one step every `STEP_S`) until it answers something
    other than RETRY, for at most `limit_s`: key -> (answer, seconds it answered RETRY before)."""
    first: dict[bytes, float] = {}
    answers: dict[bytes, tuple[object, float]] = {}
    start = time.monotonic()
    for _ in range(int(limit_s / STEP_S)):
        now = time.monotonic()
        if len(answers) == len(ks) or now - start > limit_s:
            break
        for key in ks:
            if key not in answers:
                answer = engine.manager.lookup(key)
                if answer == RETRY:
                    first.setdefault(key, now)
                else:
                    answers[key] = (answer, now - first.get(key, now))
        engine.manager.on_schedule_end()
        time.sleep(STEP_S)
    return answers


def test_a_dripped_server_answers_every_lookup_in_time_and_closes_fast(hostile):
    """Replies dripped 1 byte per 20 ms: a 4 KiB block takes 80 s to arrive. Lookups of blocks the
    engine holds handles of (promotions) and of blocks it must probe for all answer MISS within one
    step + timeout_ms; close() returns within about timeout_ms."""
    direct, slow = hostile(", breaker_failures: 1000", hot=4, drip_s=0.02)
    mine, theirs = keys(2, 7000), keys(1, 7100)
    direct.store(theirs)
    direct.manager.wait_idle(10)
    slow.store(mine)  # published through the proxy (a SET's reply is 5 bytes: 100 ms)
    slow.manager.wait_idle(10)
    slow.store(keys(4, 7200))  # the hot tier (4 blocks) lets `mine` go; their handles stay
    slow.manager.wait_idle(10)
    assert slow.stats()["resident_blocks"] >= 2, slow.stats()
    answers = drive(slow, mine + theirs, limit_s=5.0)
    names = {k: f"{'mine' if k in mine else 'theirs'}{i}" for i, k in enumerate(mine + theirs)}
    waited = {names[k]: round(w * 1000) for k, (_, w) in answers.items()}
    print(f"dripped: RETRY lasted (ms) {waited}; bound {3 * (STEP_S + TIMEOUT_S) * 1000:.0f} ms")
    assert len(answers) == 3, f"still RETRY after 5 s: {[names[k] for k in mine + theirs if k not in answers]}"
    assert all(a == MISS for a, _ in answers.values()), answers
    assert max(w for _, w in answers.values()) < 3 * (STEP_S + TIMEOUT_S), waited
    start = time.monotonic()
    slow.close()
    took = time.monotonic() - start
    print(f"dripped: close() took {took * 1000:.0f} ms")
    assert took < 3 * (TIMEOUT_S + 0.1)


def test_close_is_bounded_with_publishes_in_flight_to_a_dripping_server(hostile):
    """64 blocks being published when close() is called, each SET's reply dripped (100 ms): a
    publish job leaves unsent what it did not write within timeout_ms of being submitted, so close()
    does not wait for 16 writes per thread."""
    _, slow = hostile(", breaker_failures: 1000", hot=128, drip_s=0.02)
    slow.store(keys(64, 40_000))
    start = time.monotonic()
    slow.close()
    took = time.monotonic() - start
    print(f"dripped: close() with 64 publishes in flight took {took * 1000:.0f} ms")
    assert took < 3 * (TIMEOUT_S + 0.1)
    counters = slow.shared.counters
    assert counters["late_writes"] + counters["write_failures"] > 0, "the jobs stopped at their deadline"


def test_a_slow_server_gets_bounded_probe_work_and_opens_the_breaker(hostile):
    """Every reply 200 ms late (inside the 250 ms timeout), a new key looked up every step for 3 s:
    at most one probe in flight and MAX_QUEUED waiting, batches whose time ran out are dropped unsent,
    slow answers open the breaker, and from then on lookups answer MISS at once."""
    _, slow = hostile(", breaker_open_s: 60", delay_s=0.2)
    backend = slow.shared
    most_queued, steps, start = 0, 0, time.monotonic()
    while time.monotonic() - start < 3.0 and steps < 400:
        slow.manager.lookup(keys(1, 10_000 + steps)[0])
        slow.manager.on_schedule_end()
        most_queued = max(most_queued, backend.queued_probes)
        steps += 1
        time.sleep(STEP_S)
    elapsed = time.monotonic() - start
    sent = backend.counters["probes"]
    store = backend.store.stats()
    print(f"slow: {steps} steps in {elapsed:.1f} s, {slow.stats()['probes']} batches requested, {sent} sent, "
          f"{backend.counters.get('probes_shed', 0)} shed, at most {most_queued} queued; store {store}")
    assert most_queued <= MAX_QUEUED
    assert sent <= elapsed / 0.2 + 2, "one probe in flight at a time, each taking 200 ms"
    assert store["breaker_opens"] >= 1 and not backend.available, "slow answers opened the breaker"
    before = slow.stats()["breaker_misses"]
    assert slow.manager.lookup(keys(1, 99_999)[0]) == MISS and slow.stats()["breaker_misses"] == before + 1


def test_the_first_failure_logs_one_warning_with_its_cause(valkey_server, monkeypatch, caplog):
    """A wrong password: the first failed probe logs one WARNING naming the server and
    `AuthenticationError`; the failures after it (and the breaker opening) are counted, not logged."""
    prefix = f"kvt:wrongpw{time.monotonic_ns()}"
    valkey_server.add_acl_user("tenant-w", "the-right-one", prefix)
    monkeypatch.setenv("KVT_WRONG_PW", "not-the-right-one")
    caplog.set_level(logging.WARNING)
    engine = Engine(f", key_prefix: '{prefix}', username: tenant-w, password_env: KVT_WRONG_PW, "
                    f"breaker_open_s: 60", url=valkey_server.url)
    try:
        for i in range(200):  # until the first probe failed (bounded: 200 steps of 10 ms)
            if engine.shared.counters["probe_failures"]:
                break
            engine.manager.lookup(keys(1, 20_000 + i)[0])
            engine.manager.on_schedule_end()
            time.sleep(STEP_S)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "AuthenticationError" in warnings[0] and f"127.0.0.1:{valkey_server.port}" in warnings[0], warnings
        for i in range(400):  # more failures, until the breaker opens
            if not engine.shared.available:
                break
            engine.manager.lookup(keys(1, 30_000 + i)[0])
            engine.manager.on_schedule_end()
            time.sleep(STEP_S)
        assert not engine.shared.available and engine.shared.notice.failures >= 3
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
    finally:
        engine.close()


def test_a_read_long_after_the_probe_that_found_its_block_gets_its_own_deadline():
    """A block found by a probe is read by that probe's deadline; a read started after that deadline
    (its promotion was refused for room, a later lookup used the handle) gets its own instead of
    failing at once."""
    backend = fake_valkey(FakeServer(), timeout_ms=100, block_bytes=256)
    try:
        key = b"k" * 16
        backend.put_blocks([key], [bytearray(256)])
        backend.request_probe([key])
        for _ in range(200):  # (bounded: 2 s)
            if backend.has_probe_results:
                break
            time.sleep(STEP_S)
        assert backend.probe_results() == [([key], [True])]
        time.sleep(0.15)  # the probe's deadline passed
        assert backend.get_blocks([key], [bytearray(256)], time.monotonic() + 0.1) == 256
    finally:
        backend.close()
