"""Only live sessions count (`kvtier.control.retention`): a session whose retention ran out holds
no share and shows nowhere, even before an eviction asks for the retained blocks; a hint whose
turn retains and stores nothing leaves no session behind, so many session names cannot push out
the sessions that hold blocks; and `"kvtier": null` is no hint."""

from __future__ import annotations

from conftest import keys, memory_hierarchy

from kvtier import ReqContext
from kvtier.control.hints import Hint
from kvtier.control.retention import Retention


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------- expiry
def test_an_expired_session_holds_no_share_against_a_live_one():
    """Before (r12): expiry ran only when an eviction asked for the retained blocks, so the
    blocks of a session expired 99 s ago displaced a live session's."""
    clock = Clock()
    r = Retention(capacity=16, clock=clock)  # 8 blocks
    r.note(Hint("X", 1.0, priority=9), keys(4, 0))
    r.note(Hint("Z", 600.0, priority=0), keys(2, 100))
    clock.now += 100
    r.note(Hint("Y", 600.0), keys(4, 200))  # 10 retained if X still counted
    assert sorted(r.retaining()) == ["Y", "Z"] and "X" not in r.sessions
    assert (r.stats.expired, r.stats.displaced) == (1, 0)


def test_the_report_and_the_sessions_retaining_leave_out_an_expired_session():
    """Before (r2): `report()` and `retaining()` showed a session an hour past its 5 s."""
    clock = Clock()
    r = Retention(capacity=16, clock=clock)
    r.note(Hint("chat", 5.0), keys(3))
    clock.now += 3600
    assert r.retaining() == []
    report = r.report()
    assert (report["sessions"], report["retained_blocks"], report["expired"]) == (0, 0, 1)


def test_an_expired_sessions_blocks_are_evictable_in_the_tables_before_any_eviction():
    h = memory_hierarchy(hot=8, warm=64, cascade="on_evict")
    m = h.manager
    clock = Clock()
    m.retention.clock = clock
    ctx = ReqContext("t1", kv_transfer_params={"kvtier": {"session": "chat", "retain_s": 5}})
    out = m.prepare_store(keys(3), ctx)
    m.complete_store(out.keys_to_store, ctx)
    m.wait_idle(10)
    assert not m.tiers[0].table.victims(8)
    clock.now += 3600
    assert m.retention.report()["retained_blocks"] == 0
    assert len(m.tiers[0].table.victims(8)) == 3 and m.get_stats()["hot"]["retained_blocks"] == 0
    h.close()


# ---------------------------------------------------------------------- many session names
def test_turns_that_retain_nothing_leave_no_session_and_push_out_none():
    """Before (r3): each hint made a tracked session, so 10,000 lookups of missing blocks, each
    naming a new session, pushed out every session that held blocks."""
    r = Retention(capacity=16, max_sessions=100)
    chat = keys(4, 500)
    r.note(Hint("chat", 600.0, tenant="alice"), chat)
    r.absent = lambda ks: list(ks)  # (from now on no tier holds what is offered)
    for i in range(1000):
        r.note(Hint(f"s{i}", 3600.0, tenant="mallory"), keys(1, 10**6 + i))
    assert list(r.sessions) == ["alice\x1fchat"] and set(r.held()) == set(chat)
    assert r.stats.displaced == 0 and r.report()["sessions"] == 1


def test_over_the_session_limit_the_sessions_retaining_nothing_go_first():
    """Mallory's sessions each store blocks, give way over the share (still tracked: they
    remember what they stored) and fill the session limit: they go, not alice's live one."""
    r = Retention(capacity=8, max_sessions=3)  # 4 blocks
    r.note(Hint("chat", 600.0, tenant="alice"), keys(1, 500))
    for i in range(10):
        ks = keys(2, 10 * i)
        r.note(Hint(f"m{i}", 600.0, tenant="mallory"), ks, stored=ks)
    assert "alice\x1fchat" in r.sessions and "chat" in r.retaining()
    assert keys(1, 500)[0] in r.held() and len(r.sessions) == 3


# ---------------------------------------------------------------------- a null hint
def test_a_null_hint_is_no_hint_and_counts_nothing():
    """Before (r5): `"kvtier": null` counted a valid hint once per call of the request."""
    h = memory_hierarchy(hot=8, warm=16)
    m = h.manager
    null = ReqContext("req-2", kv_transfer_params={"kvtier": None})
    for i in range(5):
        m.touch(keys(1, 10 + i), null)
    assert m.retention.hint_of(null) is None
    report = m.retention.report()
    assert (report["hints"], report["hints_refused"], report["sessions"]) == (0, 0, 0)
    h.close()
