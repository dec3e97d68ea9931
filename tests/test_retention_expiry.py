"""When retentions run out (`kvtier.control.expiry`): the sessions whose time passed are found
without visiting the others, in the order of their last turns, at the time their latest hint set."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import keys, lines_run

from kvtier.control.hints import Hint
from kvtier.control.retention import Retention


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines_to_expire_one(tracked: int) -> int:
    """The lines `held()` runs to release the one session, of `tracked`, whose time has come."""
    clock = Clock()
    r = Retention(capacity=10 * tracked, clock=clock)
    for i in range(tracked):
        r.note(Hint(f"s{i}", 10.0 + i), keys(2, 2 * i))
    clock.now += 10.5  # (only s0's 10 s have passed)
    lines = lines_run(r.held)
    assert r.stats.expired == 1 and len(r.sessions) == tracked - 1
    return lines


def test_expiring_a_session_costs_the_same_however_many_are_tracked():
    """Before: every expiry scanned every tracked session (MAX_SESSIONS: 10,000), ~0.7 ms a
    request at 3,600 sessions."""
    few, many = lines_to_expire_one(20), lines_to_expire_one(2000)
    assert many < few + 20, (few, many)


@pytest.mark.parametrize("first, later, held_until", [(600.0, 5.0, 6.0), (5.0, 60.0, 64.0)])
def test_a_later_turns_retention_replaces_the_earlier_ones(first, later, held_until):
    """A shorter one ends the session sooner; a longer one keeps it past the first end (whose
    entry comes due and is put back). The later turn comes 1 s (shorter) or 4 s (longer) after."""
    clock = Clock()
    r = Retention(capacity=100, clock=clock)
    r.note(Hint("a", first), keys(2))
    start = clock.now
    clock.now += 1.0 if later < first else 4.0
    r.note(Hint("a", later), keys(2))
    clock.now = start + held_until - 0.5
    assert set(r.held()) == set(keys(2)) and r.stats.expired == 0
    clock.now = start + held_until + 0.5
    assert not r.held() and r.stats.expired == 1


def test_sessions_that_run_out_together_go_least_recent_turn_first():
    """Their end times are in the other order (b asked for less time after a's turn); with
    `ends_on_expiry` the order shows in their first victims."""
    clock, ended = Clock(), []
    r = Retention(capacity=100, clock=clock)
    r.on_ended, r.ends_on_expiry = ended.append, True
    r.note(Hint("a", 20.0), keys(2), stored=keys(2))
    clock.now += 5
    r.note(Hint("b", 3.0), keys(2, 10), stored=keys(2, 10))
    clock.now += 30
    assert not r.held() and r.stats.expired == 2
    assert ended == [keys(2)[::-1], keys(2, 10)[::-1]]


def test_a_session_that_ended_and_came_back_runs_out_at_its_new_time():
    clock = Clock()
    r = Retention(capacity=100, clock=clock)
    r.note(Hint("a", 5.0), keys(2))
    r.note(Hint("a", ended=True), [])
    r.note(Hint("a", 50.0), keys(2, 4))  # (the same name again: a new session)
    clock.now += 10
    assert set(r.held()) == set(keys(2, 4)) and r.stats.expired == 0
    clock.now += 41
    assert not r.held() and r.stats.expired == 1


@dataclass
class Timed:
    until: float


def test_the_entries_of_sessions_gone_are_bounded_by_the_sessions_tracked():
    from kvtier.control.expiry import Expiries

    sessions: dict[str, Timed] = {"kept": Timed(10.0**9)}
    expiries = Expiries(sessions)
    expiries.add("kept", 10.0**9)
    for i in range(10_000):  # sessions that end before their time comes (released, not expired)
        sessions[f"s{i}"] = Timed(float(i))
        expiries.add(f"s{i}", float(i))
        del sessions[f"s{i}"]
        assert len(expiries) <= 2 * 2 + 64  # (two sessions tracked at most)
    assert expiries.due(10.0**8) == [] and expiries.first == 10.0**9
