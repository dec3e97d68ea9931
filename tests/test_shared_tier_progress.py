"""The shared tier keeps making progress (on the fake server): a key gets an answer (never RETRY
forever) with `negative_ttl_s: 0` or without room for handles; a run longer than tier 0's room
still comes up from its first block; blocks whose values the server lost are published again; a
full server pauses publishing; promotions nobody loaded and refusals expire."""

from __future__ import annotations

import test_shared_tier as base
from test_shared_tier import BLOCK, MISS, RETRY, Engine, content, keys

from kvtier import build_hierarchy, load_config_text
from kvtier.control import promotion
from kvtier.control.context import ControlContext
from kvtier.control.jobs import EventLog, JobTable
from kvtier.control.promotion import Promotions

server, engines = base.server, base.engines  # the fixtures


def answer(engine: Engine, key: bytes, steps: int = 200) -> tuple[list, int]:
    """Look `key` up once per step, as vLLM does, until the answer is not RETRY."""
    answers = []
    for _ in range(steps):
        answers.append(engine.manager.lookup(key))
        if answers[-1] is not RETRY:
            break
        engine.manager.on_schedule_end()
        engine.manager.wait_idle(5)
    return answers, len(answers)


def run_answer(engine: Engine, ks: list[bytes], steps: int = 200) -> tuple[int, object]:
    """`lookup_run` once per step until its first non-HIT answer is not RETRY."""
    for _ in range(steps):
        n, result = engine.manager.lookup_run(ks)
        if result is not RETRY:
            return n, result
        engine.manager.on_schedule_end()
        engine.manager.wait_idle(5)
    return n, result


def test_a_run_longer_than_tier0_room_promotes_the_prefix_that_fits(server, engines):
    a, b = engines(hot=24), engines(hot=8)
    ks = keys(24)
    a.store(ks)
    a.manager.wait_idle(5)
    assert len(server.values) == 24
    n, result = run_answer(b, ks)
    assert 1 <= n <= 8 and result is MISS, f"{n} leading hits, then {result}"
    again = run_answer(b, ks)  # asked again before loading: the head is not evicted for the tail
    assert again == (n, MISS) or again[1] is None, again
    assert b.load(ks[:n]) == [content(k) for k in ks[:n]]


def test_a_file_run_longer_than_tier0_room_promotes_the_prefix_that_fits(tmp_path, monkeypatch):
    hierarchy, ks, _ = _file_hierarchy(tmp_path, 24, monkeypatch)
    try:
        n, result = _run(hierarchy.manager, ks)
        assert n >= 1 and result is not RETRY, f"{n} leading hits, then {result}"
    finally:
        hierarchy.close()


def test_negative_ttl_0_answers_miss_to_the_waiting_lookup_and_caches_nothing(server, engines):
    b = engines(", negative_ttl_s: 0")
    k = keys(1, 777)[0]
    answers, n = answer(b, k)
    assert answers[-1] is MISS and n <= 3, answers
    assert server.probe_sizes == [1]
    assert b.manager.lookup(k) is RETRY, "nothing cached: the next lookup probes again"
    b.settle()
    assert server.probe_sizes == [1, 1]


def test_negative_ttl_0_a_failed_probe_answers_miss(server, engines):
    b = engines(", negative_ttl_s: 0, breaker_failures: 100")
    server.down = True
    answers, _ = answer(b, keys(1, 778)[0])
    assert answers[-1] is MISS and b.stats()["probe_failures"] == 1


def test_probe_hits_beyond_the_free_handles_adopt_what_fits_and_the_rest_miss(server, engines):
    a, b = engines(hot=16), engines(hot=16, handles=2)
    ks = keys(8, 300)
    a.store(ks)
    a.manager.wait_idle(5)
    n, result = run_answer(b, ks)
    assert n == 2 and result is MISS, f"{n} leading hits, then {result}"
    assert b.load(ks[:2]) == [content(k) for k in ks[:2]]
    assert b.stats()["resident_blocks"] == 2


def test_after_the_server_lost_its_data_stale_handles_do_not_stop_a_publish(server, engines):
    a = engines(hot=4)
    ks = keys(4, 500)
    a.store(ks)
    a.manager.wait_idle(5)
    server.values.clear()  # FLUSHALL, or a restart without persistence
    a.store(keys(4, 600))  # evicts ks from the hot tier
    a.manager.wait_idle(5)
    server.values.clear()
    answers, _ = answer(a, ks[0])  # its handle is read: the value is gone
    assert answers[-1] is MISS
    a.store(ks)  # the engine recomputes the prefix
    a.manager.wait_idle(5)
    assert sorted(server.keys_of("kvt")) == sorted(ks), "every block of the prefix is published again"


def test_a_handle_older_than_its_ttl_does_not_stop_a_publish(server, engines, monkeypatch):
    import kvtier.tiers.remote.backend as valkey

    a = engines(hot=4)
    ks = keys(4, 700)
    a.store(ks)
    a.manager.wait_idle(5)
    server.values.clear()
    a.store(keys(4, 800))
    a.manager.wait_idle(5)
    a.store(ks)
    a.manager.wait_idle(5)
    assert sorted(server.keys_of("kvt")) == sorted(keys(4, 800)), "young handles dedupe"
    monkeypatch.setattr(valkey, "HANDLE_TTL_S", 0.0)
    a.store(keys(4, 800))
    a.manager.wait_idle(5)
    a.store(ks)
    a.manager.wait_idle(5)
    assert sorted(server.keys_of("kvt")) == sorted(ks + keys(4, 800))


def test_a_full_server_pauses_publishing_with_one_warning(server, engines, monkeypatch, caplog):
    from kvtier.testing.fake_remote import FakeStore, RemoteUnavailable

    def full(self, key, block):
        self.server.record_call("write_block")
        raise RemoteUnavailable("server full (maxmemory without eviction): OOM command not allowed")

    monkeypatch.setattr(FakeStore, "write_block", full)
    a = engines(", breaker_open_s: 30", hot=64)
    for i in range(10):
        a.store(keys(4, 900 + 4 * i))
        a.manager.wait_idle(5)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "publishing paused" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert server.calls["write_block"] <= 4, "publishing paused after the first failure"
    stats = a.stats()
    assert stats["publish_dropped"] == 40 and stats["resident_blocks"] == 0 and stats["stores"] == 0


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _file_hierarchy(tmp_path, stored: int, monkeypatch):
    """[memory 8 blocks, file 64 blocks] with `stored` blocks written through to the file tier,
    its promotions on a test clock (the clock `kvtier.control.promotion` reads)."""
    text = (f"block_bytes: {BLOCK}B\ntiers:\n  - {{name: hot, backend: memory, capacity: 8 blocks, policy: lru, "
            f"cascade: on_store}}\n"
            f"  - {{name: nvme, backend: file, root_dir: '{tmp_path}', capacity: 64 blocks, policy: lru}}\n")
    hierarchy = build_hierarchy(load_config_text(text), model="m")
    m, hot = hierarchy.manager, hierarchy.backends["hot"]
    ks = keys(stored)
    for i in range(0, stored, 4):
        out = m.prepare_store(ks[i:i + 4])
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            hot.view(slot)[:] = content(key)
        m.complete_store(out.keys_to_store)
        m.on_schedule_end()
        m.wait_idle(5)
    clock = Clock()
    monkeypatch.setattr(promotion, "monotonic", clock)
    return hierarchy, ks, clock


def _run(m, ks: list[bytes]) -> tuple[int, object]:
    """`lookup_run` once per step, as vLLM scans (every key past a RETRY asks too), until the
    first non-HIT answer is not RETRY."""
    for _ in range(200):
        n, result = m.lookup_run(ks)
        if result is not RETRY:
            return n, result
        for key in ks[n + 1:]:
            m.lookup(key)
        m.on_schedule_end()
        m.wait_idle(5)
    return n, result


def test_an_abandoned_promotion_does_not_starve_later_ones(tmp_path, monkeypatch):
    """P's blocks are promoted and never loaded (the request went away): within HOLD_S they stay
    (P's own lookup is still to load them), after it they are ordinary blocks and another prefix
    Q is promoted in their place. Before, Q got only the slots P had left, until an engine store
    evicted P's blocks."""
    from kvtier.control.promotion import HOLD_S

    hierarchy, ks, clock = _file_hierarchy(tmp_path, 40, monkeypatch)
    try:
        m = hierarchy.manager
        p, q = ks[:16], ks[16:32]
        got_p = _run(m, p)[0]
        assert got_p >= 2, got_p
        within = _run(m, q)[0]
        assert within <= 8 - got_p, "within HOLD_S P's promoted blocks are kept for P's load"
        clock.now += HOLD_S + 0.1
        n, _ = _run(m, q)
        assert n >= within + got_p, f"Q got {n} blocks after P's {got_p} promotions were abandoned"
        spec = m.prepare_load(q[:n])
        hot = hierarchy.backends["hot"]
        assert [bytes(hot.view(s)) for s in spec.block_ids] == [content(k) for k in q[:n]]
        m.complete_load(q[:n])
    finally:
        hierarchy.close()


def test_refusals_expire_and_are_bounded(tmp_path, monkeypatch):
    """The tail of a run longer than tier 0 is refused once; a refusal answers MISS only within
    HOLD_S (an old one made a prefix come back one block per request) and the set is bounded.
    Before, `refused` grew by the tail of every long run and never expired."""
    from kvtier.control.promotion import HOLD_S

    hierarchy, ks, clock = _file_hierarchy(tmp_path, 40, monkeypatch)
    try:
        m = hierarchy.manager
        run = ks[:24]  # in the file tier only (tier 0 holds the last 8 stored)
        n, result = _run(m, run)
        assert n >= 1 and result is MISS, (n, result)
        tail = run[n + 1:]  # refused with the first miss, not asked yet
        assert len(tail) > 4 and all(m.lookup(k) is MISS for k in tail[4:])  # (answered once: tail[:4] kept)
        m.prepare_load(ks[:n])
        m.complete_load(ks[:n])
        clock.now += HOLD_S + 0.1  # the head is loaded: tier 0 may evict it for the tail now
        got, result = _run(m, tail[:4])
        assert got == 4, f"old refusals still answered MISS: {got} of 4 blocks came back, then {result}"
        monkeypatch.setattr(promotion, "MAX_REFUSED", 4)
        promotions = Promotions(ControlContext(m.tiers, JobTable(hierarchy.router), EventLog(False), m.retention),
                                evict_for=lambda *_: None)
        promotions.refuse(ks[:10])
        assert list(promotions.refused) == ks[6:10]
    finally:
        hierarchy.close()
