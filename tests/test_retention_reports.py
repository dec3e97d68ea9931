"""What the retention reports counts every session its contract names: a session ended at its
first turn (a one-shot request) is counted in `ended`, and the tiers' `retained_blocks` in
`get_stats` leave out a session whose retention ran out, even before any turn or eviction."""

from __future__ import annotations

import pytest
from conftest import keys, memory_hierarchy

from kvtier import ReqContext
from kvtier.control.hints import Hint
from kvtier.control.retention import Retention


def test_a_session_ended_at_its_first_turn_is_counted_ended():
    r = Retention(capacity=16)
    blocks = keys(4)
    r.note(Hint("one-shot", ended=True), blocks, stored=blocks)
    r.note(Hint("chat", 60.0), keys(2, 10), stored=keys(2, 10))
    r.note(Hint("chat", ended=True), keys(2, 10))
    assert r.report()["ended"] == 2


def test_the_tiers_retained_blocks_leave_out_a_session_that_ran_out():
    hierarchy = memory_hierarchy(hot=16, warm=32)
    try:
        manager = hierarchy.manager
        now = [1000.0]
        manager.retention.clock = lambda: now[0]
        ctx = ReqContext("r", kv_transfer_params={"kvtier": {"session": "s", "retain_s": 5}})
        out = manager.prepare_store(keys(4), ctx)
        manager.complete_store(out.keys_to_store, ctx)
        assert manager.get_stats()["hot"]["retained_blocks"] == 4
        now[0] += 10
        assert manager.get_stats()["hot"]["retained_blocks"] == 0
        assert manager.retention.stats.expired == 1
    finally:
        hierarchy.close()


@pytest.mark.parametrize("same_name", [False, True], ids=["a session per request", "one session name"])
def test_each_one_shot_request_counts_once_whatever_calls_carry_its_hint(same_name):
    """Each request a load's touch, then its store: two calls ending one session. Before: the
    session ended at its first turn was never counted; then, keyed by name, once for 3 requests."""
    hierarchy = memory_hierarchy(hot=16, warm=64)
    try:
        manager = hierarchy.manager
        for i in range(3):
            hint = {"session": "u" if same_name else f"q{i}", "session_ended": True}
            ctx = ReqContext(f"r{i}", kv_transfer_params={"kvtier": hint})
            manager.touch(keys(2, 100 * i), ctx)
            out = manager.prepare_store(keys(2, 100 * i), ctx)
            manager.complete_store(out.keys_to_store, ctx)
        assert manager.retention.report()["ended"] == 3
    finally:
        hierarchy.close()


def test_each_standalone_call_that_ends_a_session_counts():
    r = Retention(capacity=16)
    for i in range(3):
        r.note(Hint("u", ended=True), keys(2, 10 * i), stored=keys(2, 10 * i))
    assert r.report()["ended"] == 3
