"""Seed 002 semantics of the single-tier LRU manager, over a slot-only backend."""

from conftest import keys

from kvtier import LookupResult, LRUOffloadingManager, ReqContext
from kvtier.tiers.memory import SlotBackend

CTX = ReqContext("r")


def make(capacity=4):
    return LRUOffloadingManager(SlotBackend("cpu", capacity, 0, block_size=16), enable_events=True)


def test_lookup_stops_at_first_missing_or_unready_block():
    m = make()
    k = keys(4)
    out = m.prepare_store(k[:3], CTX)
    m.complete_store(k[:2], CTX)  # k[2] still being written
    assert m.lookup_prefix(k, CTX) == 2
    assert m.lookup(k[2], CTX) is LookupResult.HIT_PENDING
    assert m.lookup(k[3], CTX) is LookupResult.MISS
    assert m.lookup_prefix([k[3], k[0]], CTX) == 0
    assert len(out.keys_to_store) == 3


def test_prepare_store_skips_held_blocks_and_evicts_lru():
    m = make(capacity=3)
    k = keys(5)
    m.complete_store(m.prepare_store(k[:3], CTX).keys_to_store, CTX)
    m.touch([k[0]], CTX)  # k[1] is now the least recently used
    out = m.prepare_store([k[0], k[3]], CTX)
    assert out.keys_to_store == [k[3]] and out.evicted_keys == [k[1]]


def test_prepare_store_returns_none_when_pinned_blocks_leave_no_room():
    m = make(capacity=2)
    k = keys(3)
    m.complete_store(m.prepare_store(k[:2], CTX).keys_to_store, CTX)
    m.prepare_load(k[:2], CTX)
    assert m.prepare_store([k[2]], CTX) is None
    m.complete_load(k[:1], CTX)
    assert m.prepare_store([k[2]], CTX).evicted_keys == [k[0]]


def test_failed_store_frees_its_slots():
    m = make(capacity=2)
    k = keys(2)
    m.prepare_store(k, CTX)
    m.complete_store(k, CTX, success=False)
    assert m.lookup(k[0], CTX) is LookupResult.MISS
    assert m.backend.get_num_free_blocks() == 2


def test_events_carry_medium_block_size_and_direction():
    m = make(capacity=1)
    k = keys(2)
    m.complete_store(m.prepare_store([k[0]], CTX).keys_to_store, CTX)
    m.complete_store(m.prepare_store([k[1]], CTX).keys_to_store, CTX)
    events = list(m.take_events())
    assert [(e.keys, e.removed, e.medium, e.block_size) for e in events] == [
        ([k[0]], False, "CPU", 16), ([k[0]], True, "CPU", 16), ([k[1]], False, "CPU", 16)]
    assert list(m.take_events()) == []


def test_prepare_store_never_evicts_a_key_named_in_the_same_call():
    # Seed 003: the given blocks are protected from eviction until complete_store. Evicting k[1]
    # here would leave a hole in the request's prefix (vLLM's manager evicts k[0] and keeps k[1]).
    m = make(capacity=2)
    k = keys(3)
    m.complete_store(m.prepare_store(k[:2], CTX).keys_to_store, CTX)
    m.touch([k[0]], CTX)  # k[1] is now the least recently used
    out = m.prepare_store([k[1], k[2]], CTX)
    assert out.keys_to_store == [k[2]] and out.evicted_keys == [k[0]]
    m.complete_store(out.keys_to_store, CTX)
    assert m.lookup(k[1], CTX) is LookupResult.HIT


def test_prepare_store_answers_none_when_only_the_calls_own_keys_could_go():
    m = make(capacity=1)
    k = keys(2)
    m.complete_store(m.prepare_store(k[:1], CTX).keys_to_store, CTX)
    assert m.prepare_store([k[0], k[1]], CTX) is None
    assert m.lookup(k[0], CTX) is LookupResult.HIT


def test_a_requests_loads_become_recent_when_it_finishes():
    """vLLM 0.32's recency: a load is applied at `on_request_finished`, not when it happens."""
    m = make(capacity=3)
    k = keys(5)
    writer, reader = ReqContext("w"), ReqContext("r")
    m.complete_store(m.prepare_store(k[:3], writer).keys_to_store, writer)
    m.on_request_finished(writer)  # head first: k[2] is the least recently used, k[0] the most
    m.prepare_load([k[2]], reader)
    m.complete_load([k[2]], reader)
    assert m.prepare_store([k[3]], ReqContext("x")).evicted_keys == [k[2]]  # reader still running
    m.prepare_load([k[1]], reader)
    m.complete_load([k[1]], reader)
    m.on_request_finished(reader)
    assert m.prepare_store([k[4]], ReqContext("y")).evicted_keys == [k[0]]


def test_a_finished_request_is_applied_once():
    """A request's end touches its blocks once; a second call for it changes nothing."""
    m = make(capacity=2)
    k = keys(3)
    first, second = ReqContext("a"), ReqContext("b")
    m.complete_store(m.prepare_store(k[:1], first).keys_to_store, first)
    m.complete_store(m.prepare_store(k[1:2], second).keys_to_store, second)
    m.on_request_finished(first)
    m.on_request_finished(second)
    m.on_request_finished(first)  # already applied: k[0] stays older than k[1]
    assert m.prepare_store([k[2]], CTX).evicted_keys == [k[0]]


def test_store_threshold_keeps_one_time_blocks_out():
    """vLLM's `store_threshold`: a new block is stored at its second offer; held blocks pass."""
    m = LRUOffloadingManager(SlotBackend("cpu", 4, 0, block_size=16), store_threshold=2)
    k = keys(3)
    assert m.prepare_store(k[:2], CTX).keys_to_store == []
    out = m.prepare_store(k[:3], CTX)
    assert out.keys_to_store == k[:2]
    m.complete_store(out.keys_to_store, CTX)
    assert m.prepare_store(k[:3], CTX).keys_to_store == [k[2]]
    assert m.get_stats() == {"stores_skipped": 3}
    assert LRUOffloadingManager(SlotBackend("cpu", 4, 0, block_size=16)).get_stats() is None
