"""The circuit breaker's state machine on an injected clock, and its reconnect thread."""

from __future__ import annotations

import threading

import pytest

from kvtier.tiers.remote.breaker import CircuitBreaker, Reconnector
from kvtier.tiers.remote.errors import RemoteUnavailable


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _down():
    raise ConnectionError("refused")


def test_opens_after_k_consecutive_failures_only():
    clock, opened = Clock(), []
    b = CircuitBreaker("s", failures=3, open_s=5.0, clock=clock, on_open=lambda: opened.append(1))
    b.failure("x")
    b.failure("x")
    b.success()  # resets the count: failures must be consecutive
    assert not b.failure("x") and not b.failure("x") and b.available
    assert b.failure("timeout")
    assert not b.available and b.opens == 1 and opened == [1]
    with pytest.raises(RemoteUnavailable, match="breaker open after 3 consecutive failures .last: timeout"):
        b.guard()
    assert b.fast_fails == 1
    assert not b.failure("more")  # already open: no second opening
    assert b.opens == 1 and opened == [1]


def test_check_due_after_open_s_and_only_a_successful_check_closes():
    clock = Clock()
    b = CircuitBreaker("s", failures=1, open_s=5.0, clock=clock)
    assert b.seconds_to_check() is None
    b.failure("down")
    assert b.seconds_to_check() == 5.0
    clock.now += 5.0
    assert b.seconds_to_check() == 0.0
    assert not b.try_close(_down)  # still down: next check open_s later
    assert not b.available and b.seconds_to_check() == 5.0
    with pytest.raises(RemoteUnavailable, match="last: refused"):
        b.guard()
    clock.now += 5.0
    assert b.try_close(lambda: None)
    assert b.available and b.closes == 1 and b.seconds_to_check() is None
    b.guard()
    b.failure("again")  # K = 1: the count restarted at close
    assert not b.available and b.opens == 2


def test_reconnector_runs_poll_when_woken_and_when_due():
    calls, ran = [], threading.Event()

    def poll():
        calls.append(1)
        if len(calls) >= 3:
            ran.set()
            return None
        return 0.01  # due again in 10 ms

    r = Reconnector("test-reconnect", poll)
    try:
        assert not ran.wait(0.2)  # nothing open: sleeps until woken
        assert calls == []
        r.wake()
        assert ran.wait(5)
        assert len(calls) == 3
    finally:
        r.stop()
