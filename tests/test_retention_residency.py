"""A session retains only blocks some tier holds, on every path: a block offered and not stored
(no room, skipped by the store threshold) never joins it, and a retained block that leaves every
tier is forgotten, so neither takes the share from sessions whose blocks are there. Sessions are
each tenant's own, and the hint counters count requests, not the scheduler's calls."""

from __future__ import annotations

import pytest
from conftest import keys, memory_hierarchy
from test_standalone import make_kv

from kvtier import load_config_text
from kvtier.core.types import ReqContext
from kvtier.standalone import KVTier


def hinted(req_id: str, session: str, **fields) -> ReqContext:
    return ReqContext(req_id, kv_transfer_params={"kvtier": {"session": session, "retain_s": 300, **fields}})


def test_blocks_skipped_by_the_store_threshold_do_not_take_the_share_from_a_stored_session():
    """Before: session B's eight keys, offered once and so not stored, were retained in name and
    took the whole budget (8 of a 16-block tier): A lost its retention, then its blocks."""
    cfg = load_config_text("store_threshold: 2\ntiers:\n  - {name: m, backend: memory, capacity: 16 blocks}\n")
    with KVTier.open(cfg, make_kv(64)) as tier:
        a, b = keys(8), keys(8, 50)
        tier.store(a, list(range(8)))  # (first offer: skipped)
        assert tier.store(a, list(range(8)), hints={"session": "A", "retain_s": 300})
        tier.store(b, list(range(8, 16)), hints={"session": "B", "retain_s": 300})  # skipped: nothing stored
        report = tier.stats()["engine"]["retention"]
        assert report["retained_blocks"] == 8 and report["displaced"] == 0 and report["sessions"] == 1
        for i in range(4):  # other traffic, each offered twice, past the tier's room
            other = keys(4, 200 + 4 * i)
            tier.store(other, list(range(20, 24)))
            tier.store(other, list(range(20, 24)))
        assert tier.lookup(a) == 8


def test_a_refused_store_does_not_join_its_blocks_to_the_session():
    """vLLM's path: a `prepare_store` answered "no room yet" stored nothing; before, its keys
    joined the session all the same."""
    h = memory_hierarchy(hot=4, warm=16, cascade="none")
    m = h.manager
    pin = ReqContext("reader")
    out = m.prepare_store(keys(4), pin)
    m.complete_store(out.keys_to_store, pin)
    m.prepare_load(keys(4), pin)  # (every block pinned: no room)
    assert m.prepare_store(keys(2, 100), hinted("r1", "s")) is None
    assert not m.retention.held() and m.retention.report()["retained_blocks"] == 0
    m.complete_load(keys(4), pin)
    h.close()


def test_retained_blocks_evicted_from_every_tier_leave_the_session():
    """Before: a store the tier could not take otherwise evicted the retained blocks (`kept_past`),
    and the retention still counted them as held, against the share."""
    h = memory_hierarchy(hot=8, warm=16, cascade="none")
    m = h.manager
    out = m.prepare_store(keys(4), hinted("r1", "s"))
    m.complete_store(out.keys_to_store, hinted("r1", "s"))
    assert len(m.retention.held()) == 4
    plain = ReqContext("big")
    out = m.prepare_store(keys(8, 100), plain)  # the whole tier
    assert out is not None and m.retention.stats.kept_past == 1
    m.complete_store(out.keys_to_store, plain)
    report = m.retention.report()
    assert report["retained_blocks"] == 0 and report["sessions"] == 0 and not m.retention.held()
    h.close()


def test_a_retained_block_that_moves_down_a_tier_stays_retained():
    """Leaving one tier is not leaving the hierarchy: a block evicted past the share from the
    first tier is copied to the next and stays retained there."""
    h = memory_hierarchy(hot=8, warm=32, cascade="on_evict")
    m = h.manager
    out = m.prepare_store(keys(4), hinted("r1", "s"))
    m.complete_store(out.keys_to_store, hinted("r1", "s"))
    plain = ReqContext("big")
    for _ in range(50):
        out = m.prepare_store(keys(8, 100), plain)
        if out is not None:
            break
        m.on_schedule_end()
        m.wait_idle(10)
    assert out is not None and m.retention.stats.kept_past == 1
    m.complete_store(out.keys_to_store, plain)
    assert len(m.retention.held()) == 4 and m.retention.report()["retained_blocks"] == 4
    assert all(h.manager.tiers[1].table.get(k) is not None for k in keys(4))
    h.close()


def test_another_tenants_session_of_the_same_name_is_another_session():
    """Before: tenant Y ending its "chat-42" released tenant X's "chat-42" and made X's blocks
    every tier's first victims."""
    h = memory_hierarchy(hot=16, warm=32)
    m = h.manager
    x = hinted("x1", "chat-42", tenant="X")
    out = m.prepare_store(keys(4), x)
    m.complete_store(out.keys_to_store, x)
    m.prepare_store([], hinted("y1", "chat-42", tenant="Y", session_ended=True))
    report = m.retention.report()
    # (Y's session ended, counted as every ended session is; X's is untouched)
    assert report["ended"] == 1 and report["sessions"] == 1 and report["retained_blocks"] == 4
    assert not h.manager.tiers[0].first_victims and m.retention.by_tenant == {"X": 4}
    h.close()


@pytest.mark.parametrize("hint, counter", [({"session": "s", "retain_s": 60}, "hints"),
                                           ({"session": "s", "retain_s": -1}, "hints_refused")])
def test_a_requests_hint_is_counted_once_however_many_calls_carry_it(hint, counter):
    """Before: four `prepare_store` calls of one request counted four hints (or four refusals)."""
    h = memory_hierarchy(hot=16, warm=32)
    m = h.manager
    ctx = ReqContext("r1", kv_transfer_params={"kvtier": hint})
    for i in range(4):
        out = m.prepare_store(keys(1, i), ctx)
        m.complete_store(out.keys_to_store, ctx)
    assert m.retention.report()[counter] == 1
    h.close()
