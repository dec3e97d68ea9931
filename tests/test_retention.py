"""Retention hints (issue 40, first part): a session's blocks are kept out of every eviction in
every tier until `retain_s` after its last turn; hints are validated, bounded and harmless when
absent (`kvtier.control.retention`)."""

from __future__ import annotations

import pytest
from conftest import keys, memory_hierarchy

from kvtier import ReqContext
from kvtier.control.hints import MAX_RETAIN_S, Hint, parse_hint
from kvtier.control.retention import Retention
from kvtier.core.errors import ArgumentError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------- parsing
def test_a_valid_hint_is_read_with_its_defaults():
    assert parse_hint({"session": "chat-1", "retain_s": 30}) == Hint("chat-1", 30.0, 0, False, "")
    assert parse_hint({"session": "s", "retain_s": 1.5, "priority": 9, "tenant": "t", "session_ended": True}) == \
        Hint("s", 1.5, 9, True, "t")
    assert parse_hint(None) is None


@pytest.mark.parametrize("value, field, says", [
    ({"retain_s": 3}, "hints.session", "non-empty string"),
    ({"session": "", "retain_s": 3}, "hints.session", "non-empty string"),
    ({"session": "x" * 129, "retain_s": 3}, "hints.session", "at most 128 printable"),
    ({"session": "a\nb", "retain_s": 3}, "hints.session", "printable"),
    ({"session": "s", "retain_s": MAX_RETAIN_S + 1}, "hints.retain_s", "from 0 to 3600"),
    ({"session": "s", "retain_s": -1}, "hints.retain_s", "from 0 to 3600"),
    ({"session": "s", "retain_s": True}, "hints.retain_s", "number of seconds"),
    ({"session": "s", "retain_s": "60"}, "hints.retain_s", "number of seconds"),
    ({"session": "s", "retain_s": 1, "priority": 10}, "hints.priority", "from 0 to 9"),
    ({"session": "s", "retain_s": 1, "priority": 1.0}, "hints.priority", "integer"),
    ({"session": "s", "retain_s": 1, "session_ended": "yes"}, "hints.session_ended", "true or false"),
    ({"session": "s", "retain_s": 1, "tenant": 7}, "hints.tenant", "must be a string"),
    ({"session": "s", "retain": 1}, "hints", "unknown field(s) retain"),
    (["session", "s"], "hints", "must be a mapping"),
])
def test_a_bad_hint_names_its_field_and_what_is_right(value, field, says):
    with pytest.raises(ArgumentError) as info:
        parse_hint(value, "hints")
    assert str(info.value).startswith(field + ":") and says in str(info.value), str(info.value)


def test_numbers_of_other_classes_are_taken_as_their_value_and_nan_is_refused():
    class Seconds(float):  # (e.g. numpy.float64, a float subclass)
        pass

    class Level(int):
        pass

    assert parse_hint({"session": "s", "retain_s": Seconds(2.5), "priority": Level(3)}) == Hint("s", 2.5, 3)
    with pytest.raises(ArgumentError, match="retain_s"):
        parse_hint({"session": "s", "retain_s": float("nan")})
    with pytest.raises(ArgumentError, match="priority"):
        parse_hint({"session": "s", "retain_s": 1, "priority": False})


def test_a_hint_changed_in_place_between_a_requests_calls_is_read_again():
    r = Retention(capacity=100)
    params = {"kvtier": {"session": "s", "retain_s": 60}}
    turn = ReqContext("turn-1", kv_transfer_params=params)
    assert r.hint_of(turn) == Hint("s", 60.0)
    assert r.hint_of(turn) == Hint("s", 60.0)  # (parsed once; the same answer)
    params["kvtier"]["session_ended"] = True  # (a client's dict, changed in place)
    assert r.hint_of(turn) == Hint("s", 60.0, ended=True)
    params["kvtier"]["retain_s"] = -1
    assert r.hint_of(turn) is None and r.stats.hints_refused == 1
    other = ReqContext("turn-2", kv_transfer_params={"kvtier": {"session": "t", "retain_s": 5}})
    assert r.hint_of(other) == Hint("t", 5.0) and r.hint_of(turn) is None


# ---------------------------------------------------------------------- the bounds
def test_a_session_is_kept_until_its_retention_runs_out_after_its_last_turn():
    clock = Clock()
    r = Retention(capacity=100, clock=clock)
    r.note(Hint("a", 10.0), keys(3))
    clock.now += 8
    r.note(Hint("a", 10.0), keys(2, 3))  # the next turn: 10 s from now, blocks added
    clock.now += 8
    assert set(r.held()) == set(keys(5))
    clock.now += 3
    assert not r.held() and r.stats.expired == 1 and r.report()["sessions"] == 0


@pytest.mark.parametrize("ends_on_expiry", [False, True])
def test_a_session_that_runs_out_ends_only_when_asked_to(ends_on_expiry):
    """`ends_on_expiry` (off by default; benchmarks/session_inference.py): a session whose
    retention runs out counts as ended, so the blocks it stored go first, deep end first."""
    clock, ended = Clock(), []
    r = Retention(capacity=100, clock=clock)
    r.on_ended, r.ends_on_expiry = ended.extend, ends_on_expiry
    r.note(Hint("a", 10.0), keys(3), stored=keys(2, 1))
    clock.now += 11
    assert not r.held() and r.stats.expired == 1
    assert ended == (keys(2, 1)[::-1] if ends_on_expiry else [])


def test_an_ended_session_is_released_at_once():
    r = Retention(capacity=100)
    r.note(Hint("a", 60.0), keys(3))
    r.note(Hint("a", ended=True), [])
    assert not r.held() and r.stats.ended == 1


def test_retained_blocks_hold_at_most_the_share_and_the_biggest_tenant_gives_way():
    r = Retention(capacity=20, share=0.5)  # 10 blocks
    r.note(Hint("t1-low", 60.0, priority=0, tenant="t1"), keys(4, 0))
    r.note(Hint("t1-high", 60.0, priority=5, tenant="t1"), keys(4, 10))
    r.note(Hint("t2", 60.0, priority=0, tenant="t2"), keys(3, 20))  # 11 > 10: t1 holds the most
    assert set(r.retaining()) == {"t1-high", "t2"} and len(r.held()) == 7 and r.stats.displaced == 1
    r.note(Hint("t1-low", 60.0, priority=0, tenant="t1"), keys(1, 4))  # its next turn: retained again
    assert "t1-low" in r.retaining() and len(r.held()) <= 10


def test_a_displaced_session_that_ends_still_leaves_first_what_it_stored():
    ended: list[list[bytes]] = []
    r = Retention(capacity=8, share=0.5)  # 4 blocks
    r.on_ended = ended.append
    r.note(Hint("a", 60.0), keys(3), stored=keys(3))
    r.note(Hint("b", 60.0), keys(3, 10), stored=keys(3, 10))  # over the share: a is displaced
    assert r.retaining() == ["b"]
    r.note(Hint("a", ended=True), keys(4), stored=keys(1, 3))
    assert ended == [keys(4)[::-1]]  # all a stored, deep end first


def test_the_stored_blocks_remembered_are_bounded():
    r = Retention(capacity=4)  # at most 8 stored blocks remembered in all
    for i in range(6):
        r.note(Hint(f"s{i}", 60.0), keys(3, 10 * i), stored=keys(3, 10 * i))
    ended: list[list[bytes]] = []
    r.on_ended = ended.append
    r.note(Hint("s0", ended=True), [])  # its stored blocks were the oldest: forgotten
    r.note(Hint("s5", ended=True), [])
    assert ended == [keys(3, 50)[::-1]]


def test_one_session_past_the_share_keeps_its_prefix():
    r = Retention(capacity=8, share=0.5)
    r.note(Hint("long", 60.0), keys(10))
    assert list(r.held()) == keys(4)


def test_at_most_max_sessions_are_tracked_oldest_turn_first_forgotten():
    r = Retention(capacity=1000, max_sessions=2)
    for name in ("a", "b", "c"):
        r.note(Hint(name, 60.0), keys(1, ord(name)))
    assert list(r.sessions) == ["b", "c"] and r.stats.displaced == 1


def test_a_shared_block_stays_retained_while_a_session_using_it_is_live():
    clock = Clock()
    r = Retention(capacity=100, clock=clock)
    r.note(Hint("a", 5.0), keys(2))
    r.note(Hint("b", 50.0), keys(2))  # the same shared prefix, retained by both
    clock.now += 10
    assert set(r.held()) == set(keys(2))  # a expired; b keeps them


# ---------------------------------------------------------------------- in the hierarchy
def burst(h, n, start, ctx):
    """`n` one-time blocks stored one request at a time (each evicts when the first tier is full)."""
    m = h.manager
    for key in keys(n, start):
        for _ in range(50):
            out = m.prepare_store([key], ctx)
            if out is not None:
                break
            m.on_schedule_end()
        assert out is not None
        m.complete_store(out.keys_to_store, ctx)
        m.on_schedule_end()
    h.manager.wait_idle(10)


def stored(h, ks, ctx):
    out = h.manager.prepare_store(ks, ctx)
    h.manager.complete_store(out.keys_to_store, ctx)
    h.manager.wait_idle(10)


@pytest.mark.parametrize("cascade", ["on_evict", "on_store", "none"])
def test_a_retained_session_survives_a_burst_that_evicts_it_without_a_hint(cascade):
    hinted = ReqContext("turn-1", kv_transfer_params={"kvtier": {"session": "chat", "retain_s": 600}})
    plain = ReqContext("turn-1")
    kept = {}
    for name, ctx in (("hint", hinted), ("none", plain)):
        h = memory_hierarchy(hot=8, warm=64, cascade=cascade)
        chat = keys(3, 1000)
        stored(h, chat, ctx)
        burst(h, 20, 0, ReqContext("burst"))
        hot = h.manager.tiers[0]
        kept[name] = [hot.table.get(k) is not None for k in chat]
        if cascade != "none":  # nothing lost: every block is still somewhere
            assert all(any(t.table.get(k) is not None for t in h.manager.tiers) for k in chat + keys(20))
        h.close()
    assert kept == {"hint": [True] * 3, "none": [False] * 3}


class ProtectedSizes:
    """A tier's block table that records the size of each eviction's `protected` set."""

    def __init__(self, table) -> None:
        self.table, self.sizes = table, []

    def evict_ids(self, n, protected):
        self.sizes.append(len(protected))
        return self.table.evict_ids(n, protected)

    def __getattr__(self, name):
        return getattr(self.table, name)


@pytest.mark.parametrize("policy", ["lru", "prefix-freq", "arc"])
def test_retained_blocks_are_held_in_the_table_so_an_eviction_does_not_walk_them(policy):
    """The cost of an eviction does not grow with the retained blocks: they are held in every
    tier's table (`BlockTable.hold`), not passed to each eviction as protected keys, and stay
    held in the tier below once copied there."""
    h = memory_hierarchy(hot=64, warm=256, hot_policy=policy)
    hot, warm = h.manager.tiers
    chat = keys(30, 5000)
    stored(h, chat, ReqContext("turn-1", kv_transfer_params={"kvtier": {"session": "chat", "retain_s": 600}}))
    hot.table = ProtectedSizes(hot.table)
    burst(h, 100, 0, ReqContext("burst"))
    assert hot.table.sizes and max(hot.table.sizes) < 5, hot.table.sizes
    assert all(hot.table.get(k) is not None for k in chat)
    assert set(chat) <= hot.table.pinned_keys()
    h.close()


def test_a_retention_holds_blocks_in_the_tier_they_are_in_and_in_the_tier_they_enter():
    h = memory_hierarchy(hot=8, warm=64)
    m = h.manager
    hot, warm = m.tiers
    chat = keys(3, 5000)
    stored(h, chat, ReqContext("turn-1"))
    burst(h, 20, 0, ReqContext("burst"))  # no hint yet: the chat goes down to the warm tier
    assert all(hot.table.get(k) is None and warm.table.get(k) is not None for k in chat)
    turn = ReqContext("turn-2", kv_transfer_params={"kvtier": {"session": "chat", "retain_s": 600}})
    m.touch(chat, turn)  # the session's hit: held where the blocks are
    assert set(chat) <= warm.table.pinned_keys()
    for _ in range(50):  # promoted back up: held in the tier they enter
        if m.lookup_run(chat, turn)[0] == len(chat):
            break
        m.on_schedule_end()
        m.wait_idle(10)
    assert set(chat) <= hot.table.pinned_keys() and set(chat) <= warm.table.pinned_keys()
    m.touch(chat, ReqContext("turn-3", kv_transfer_params={"kvtier": {"session": "chat", "session_ended": True}}))
    assert not set(chat) & (hot.table.pinned_keys() | warm.table.pinned_keys())
    h.close()


def test_the_hint_is_read_from_vllms_request_and_a_bad_one_is_refused_not_raised(caplog):
    h = memory_hierarchy(hot=16, warm=32)
    m = h.manager
    bad = ReqContext("r-bad", kv_transfer_params={"kvtier": {"session": "s", "retain_s": 99999}})
    stored(h, keys(2), bad)
    stored(h, keys(2, 10), bad)
    assert not m.retention.held() and m.retention.stats.hints_refused == 1  # (once per request)
    assert sum("retention hint refused" in r.message and "retain_s" in r.message for r in caplog.records) == 1
    good = ReqContext("r-good", kv_transfer_params={"kvtier": {"session": "s", "retain_s": 60}})
    stored(h, keys(2, 20), good)
    m.touch(keys(2), good)  # a hit joins the session too
    m.prepare_load(keys(1, 10), good)  # so does a load
    m.complete_load(keys(1, 10), good)
    assert set(m.retention.held()) == set(keys(2, 20) + keys(2) + keys(1, 10))
    h.close()


def test_without_hints_nothing_is_retained_or_reported():
    h = memory_hierarchy(hot=4, warm=16)
    burst(h, 10, 0, ReqContext("r", kv_transfer_params={"other": 1}))
    assert not h.manager.retention.held() and h.manager.retention.stats.hints == 0
    h.close()


def test_retained_blocks_are_kept_like_pinned_ones_and_give_way_only_to_a_store_that_needs_them():
    """With the other blocks pinned by a load, a store waits ("no room yet") rather than take a
    retained block; a store the tier could not take even with every pin released evicts them."""
    h = memory_hierarchy(hot=4, warm=32, cascade="none")
    m = h.manager
    ctx = ReqContext("r", kv_transfer_params={"kvtier": {"session": "s", "retain_s": 600}})
    stored(h, keys(2), ctx)
    plain = ReqContext("p")
    stored(h, keys(2, 10), plain)
    m.prepare_load(keys(2, 10), plain)  # the two other blocks: pinned by a load
    assert m.prepare_store(keys(1, 20), plain) is None and m.retention.stats.kept_past == 0
    m.complete_load(keys(2, 10), plain)
    stored(h, keys(1, 20), plain)  # room now: an unretained block goes
    assert all(m.tiers[0].table.get(k) is not None for k in keys(2)) and m.retention.stats.kept_past == 0
    out = m.prepare_store(keys(4, 30), plain)  # the whole tier: only with the retained blocks gone
    assert out is not None and len(out.keys_to_store) == 4 and m.retention.stats.kept_past == 1
    m.complete_store(out.keys_to_store, plain)
    h.close()


def test_the_standalone_api_takes_hints_checks_them_first_and_reports_them():
    torch = pytest.importorskip("torch")
    from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, load_config_text
    from kvtier.standalone import KVTier

    page = 256
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros(64, page, dtype=torch.int8), page)],
                           [[CanonicalKVCacheRef(0, page)]])
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks, pin: false}\n")
    with KVTier.open(cfg, kv) as tier:
        with pytest.raises(ArgumentError, match=r"^hints\.retain_s: must be a number of seconds"):
            tier.store(keys(2), [0, 1], hints={"session": "s", "retain_s": -3})
        assert tier.stats()["engine"]["stores"] == 0 and "retention" not in tier.stats()["engine"]
        chat = keys(3, 500)
        assert tier.store(chat, [0, 1, 2], hints={"session": "chat", "retain_s": 600})
        for i in range(4):  # one-time blocks, enough to evict the chat without its hint
            assert tier.store(keys(4, 10 * i), [3, 4, 5, 6])
        assert tier.lookup(chat) == 3
        assert tier.load(chat, [7, 8, 9], hints={"session": "chat", "session_ended": True}) == 3
        report = tier.stats()["engine"]["retention"]
        assert report["hints"] == 2 and report["ended"] == 1 and report["retained_blocks"] == 0


# ---------------------------------------------------------------------- ended sessions
def chat_then_others(h, ended: bool):
    """Four plain blocks (the oldest), then a four-block chat turn with a hint; then the chat's
    last turn, ended or not (a touch of its chain)."""
    stored(h, keys(4, 0), ReqContext("plain"))
    chat = keys(4, 1000)
    stored(h, chat, ReqContext("t1", kv_transfer_params={"kvtier": {"session": "c", "retain_s": 600}}))
    last = {"session": "c", "retain_s": 600, **({"session_ended": True} if ended else {})}
    h.manager.touch(chat, ReqContext("t2", kv_transfer_params={"kvtier": last}))
    return chat


@pytest.mark.parametrize("cascade", ["on_evict", "on_store", "none"])
def test_an_ended_sessions_blocks_are_the_first_victims_deep_end_first(cascade):
    gone = {}
    for ended in (False, True):
        h = memory_hierarchy(hot=8, warm=64, cascade=cascade)
        chat = chat_then_others(h, ended)
        stored(h, keys(2, 500), ReqContext("new"))  # a full first tier: two blocks must go
        hot = h.manager.tiers[0]
        gone[ended] = [k for k in keys(4, 0) + chat if hot.table.get(k) is None]
        if cascade != "none":  # nothing lost: the ended blocks went below first
            assert all(h.manager.tiers[1].table.get(k) is not None for k in gone[ended])
        assert h.manager.retention.stats.evicted_ended == (2 if ended else 0)
        h.close()
    assert set(gone[False]) < set(keys(4, 0)) and len(gone[False]) == 2  # LRU's oldest: plain blocks
    assert gone[True] == keys(4, 1000)[2:]  # the ended chat's deep end


def test_an_ended_sessions_blocks_are_first_victims_in_the_tier_below_too():
    """The chat's blocks reach the warm tier after older one-time blocks; once the chat ended,
    they leave it first all the same."""
    outcome = {}
    for ended in (False, True):
        h = memory_hierarchy(hot=4, warm=8, cascade="on_evict")
        stored(h, keys(4, 0), ReqContext("b0"))
        chat = keys(4, 1000)
        stored(h, chat, ReqContext("t1", kv_transfer_params={"kvtier": {"session": "c", "retain_s": 600}}))
        last = {"session": "c", "retain_s": 0, **({"session_ended": True} if ended else {})}
        h.manager.touch(chat, ReqContext("t2", kv_transfer_params={"kvtier": last}))
        for i in (1, 2):  # the chat, then b1, go down to a full warm tier
            stored(h, keys(4, 10 * i), ReqContext(f"b{i}"))
        warm = h.manager.tiers[1]
        outcome[ended] = ([warm.table.get(k) is not None for k in chat],
                          [warm.table.get(k) is not None for k in keys(4, 0)])
        h.close()
    assert outcome == {False: ([True] * 4, [False] * 4), True: ([False] * 4, [True] * 4)}


def test_a_block_used_again_is_no_first_victim_and_a_live_sessions_block_never_is():
    h = memory_hierarchy(hot=8, warm=64, cascade="none")
    chat = chat_then_others(h, ended=True)
    h.manager.touch(chat[2:], ReqContext("reader"))  # a request without hints reads the deep end again
    live = ReqContext("t", kv_transfer_params={"kvtier": {"session": "other", "retain_s": 600}})
    h.manager.touch(chat[:1], live)  # another session retains the head
    stored(h, keys(4, 500), ReqContext("new"))
    hot = h.manager.tiers[0]
    # the chat's second block first (the head is retained, the deep end used again), then LRU's
    assert {k for k in keys(4, 0) + chat if hot.table.get(k) is None} == {chat[1], *keys(3, 1)}
    h.close()


def test_the_stats_say_per_tier_what_is_retained_and_what_goes_first():
    h = memory_hierarchy(hot=8, warm=64, cascade="on_evict")
    chat = keys(4, 1000)
    stored(h, chat, ReqContext("t1", kv_transfer_params={"kvtier": {"session": "c", "retain_s": 600}}))
    rows = h.manager.get_stats()
    assert (rows["hot"]["retained_blocks"], rows["warm"]["retained_blocks"], rows["hot"]["ended_blocks"]) == (4, 0, 0)
    h.manager.touch(chat, ReqContext("t2", kv_transfer_params={"kvtier": {"session": "c", "session_ended": True}}))
    rows = h.manager.get_stats()
    assert (rows["hot"]["retained_blocks"], rows["hot"]["ended_blocks"], rows["warm"]["ended_blocks"]) == (0, 4, 0)
    h.close()


def test_a_one_shot_request_leaves_first_only_the_blocks_it_stored_not_the_prefix_it_shared():
    """A request ended at its first turn (a one-shot call): its own new blocks go first; the
    system prompt it found stored is an ordinary block."""
    h = memory_hierarchy(hot=8, warm=64, cascade="none")
    system = keys(2, 900)
    stored(h, system, ReqContext("sys"))
    stored(h, keys(3, 0), ReqContext("plain"))  # older than the one-shot's blocks
    once = ReqContext("once", kv_transfer_params={"kvtier": {"session": "q1", "session_ended": True}})
    h.manager.touch(system, once)  # its hit of the system prompt...
    stored(h, system + keys(3, 500), once)  # ...and its own three blocks
    stored(h, keys(5, 700), ReqContext("new"))  # a full first tier: five blocks must go
    hot = h.manager.tiers[0]
    assert all(hot.table.get(k) is not None for k in system)
    assert all(hot.table.get(k) is None for k in keys(3, 500))  # first, then two of the older plain ones
    assert sum(hot.table.get(k) is None for k in keys(3, 0)) == 2
    assert h.manager.retention.stats.evicted_ended == 3
    h.close()


def test_only_tenants_holding_blocks_are_counted():
    """Tenant names come from clients: a tenant whose sessions hold nothing is forgotten, so many
    names over time cost nothing once their sessions are gone."""
    r = Retention(capacity=8, share=0.5)  # 4 blocks
    for i in range(200):
        r.note(Hint(f"s{i}", 60.0, tenant=f"tenant-{i}"), keys(2, 10 * i))
    tenant_of = {f"s{i}": f"tenant-{i}" for i in range(200)}
    assert set(r.by_tenant) == {tenant_of[name] for name in r.retaining()}
    assert all(count > 0 for count in r.by_tenant.values()) and sum(r.by_tenant.values()) == len(r.held())
    for name in r.retaining():
        r.note(Hint(name, ended=True, tenant=tenant_of[name]), [])
    assert r.by_tenant == {} and not r.held()


def test_the_standalone_api_evicts_an_ended_session_first_too():
    torch = pytest.importorskip("torch")
    from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, load_config_text
    from kvtier.standalone import KVTier

    page = 256
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros(64, page, dtype=torch.int8), page)],
                           [[CanonicalKVCacheRef(0, page)]])
    cfg = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks, policy: lru, pin: false}\n")
    with KVTier.open(cfg, kv) as tier:
        assert tier.store(keys(4), [0, 1, 2, 3])  # older than the chat
        chat = keys(4, 500)
        assert tier.store(chat, [4, 5, 6, 7], hints={"session": "chat", "retain_s": 600})
        assert tier.load(chat, [8, 9, 10, 11], hints={"session": "chat", "session_ended": True}) == 4
        assert tier.store(keys(2, 900), [12, 13])  # a full tier: two blocks go, the chat's deep end
        assert tier.lookup(chat) == 2 and tier.lookup(keys(4)) == 4
        assert tier.stats()["engine"]["retention"]["evicted_ended"] == 2
