"""Sessions' retention hints under vLLM with `shared: host` behave and are reported as with a private
hierarchy: an ended session's history stays its first victims when the request that ended it
finishes (the engine's touch used to reach the owner without the hint, which took it as a reuse);
`vllm:kvtier_retention_*` and the tiers' `_retained_blocks` / `_ended_blocks` are exported (they
were missing); a refused hint is logged once per request and counted once in `hints_refused`
(it was logged at debug and counted nowhere)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402

from kvtier import load_config_text  # noqa: E402
from kvtier.config.shared import SharedHost  # noqa: E402
from kvtier.control.manager import HierarchyManager  # noqa: E402
from kvtier.host.client import HostClient  # noqa: E402
from kvtier.host.owner import HostOwner  # noqa: E402
from kvtier.integrations.vllm.host_manager import HostOffloadingManager  # noqa: E402
from kvtier.integrations.vllm.retention_metrics import PREFIX, record_retention  # noqa: E402

TIERS = "tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks}\n"


def keys(n, start=0):
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(start, start + n)]


def request(name, **hint):
    return ReqContext(name, kv_transfer_params={"kvtier": hint})


@pytest.fixture
def owner():
    where = tempfile.mkdtemp(prefix="kvh", dir="/tmp")  # (a socket path holds at most 107 bytes)
    host = HostOwner(os.path.join(where, "run", "host.sock"), max_clients=4, lease_grace_s=0.3)
    yield host
    host.close(flush_timeout=5)
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def engine(owner):
    hello = {"identity": {"model": f"m-{uuid.uuid4().hex[:8]}", "block_bytes": 4096, "block_tokens": 16},
             "config": {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "8 blocks"}]}}
    client = HostClient(SharedHost(owner.socket_path, 2000), hello)
    yield HostOffloadingManager(client, load_config_text(TIERS))
    client.close()


def stored(manager, keys_, ctx):
    out = manager.prepare_store(keys_, ctx)
    manager.complete_store(out.keys_to_store, ctx)


def values(stats, name):
    return stats.data["data"].get(name, {})


def test_an_ended_sessions_history_stays_first_victims_when_its_request_finishes(engine):
    history = keys(4)
    first, last = request("turn-1", session="chat", retain_s=600), request("turn-2", session="chat",
                                                                            session_ended=True)
    stored(engine, history, first)
    engine.on_request_finished(first)
    engine.prepare_load(history, last)
    engine.complete_load(history, last)
    assert engine.tier_stats()["cpu"]["ended_blocks"] == 4
    engine.on_request_finished(last)  # (the engine touches what the request loaded)
    assert engine.tier_stats()["cpu"]["ended_blocks"] == 4


def test_a_request_without_a_hint_still_makes_an_ended_sessions_blocks_ordinary(engine):
    history = keys(4)
    stored(engine, history, request("turn-1", session="chat", retain_s=600))
    engine.touch(history, request("turn-2", session="chat", session_ended=True))
    assert engine.tier_stats()["cpu"]["ended_blocks"] == 4
    engine.touch(history, ReqContext("another"))  # used again: no first victim any more
    assert engine.tier_stats()["cpu"]["ended_blocks"] == 0


def test_the_engine_exports_the_retention_metrics_of_a_private_hierarchy(engine):
    ctx = request("r1", session="chat", retain_s=600)
    stored(engine, keys(3), ctx)
    stored(engine, keys(4), ctx)  # (the same request again: one hint)
    engine.on_request_finished(ctx)
    stats = engine.get_stats()
    assert values(stats, "vllm:kvtier_retained_blocks") == {("cpu",): 4}
    assert values(stats, "vllm:kvtier_ended_blocks") == {("cpu",): 0}
    assert values(stats, PREFIX + "hints") == {(): 1}
    assert values(stats, PREFIX + "sessions") == {(): 1}
    assert values(stats, PREFIX + "retained_blocks") == {(): 4}
    assert values(stats, PREFIX + "budget_blocks") == {(): 4}
    again = engine.get_stats()  # (counters are deltas; gauges are reported every time)
    assert PREFIX + "hints" not in again.data["data"] and values(again, PREFIX + "sessions") == {(): 1}
    assert engine.tier_stats()["engine"]["retention"]["retained_blocks"] == 4


def test_a_refused_hint_is_logged_and_counted_once_per_request(engine, caplog):
    bad = request("req-1", session="s", retain_s="600")
    with caplog.at_level(logging.WARNING):
        stored(engine, keys(2), bad)  # (served without the hint)
        engine.prepare_store(keys(2), bad)
        engine.touch(keys(2), bad)
    warnings = [r for r in caplog.records if "req-1" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "retain_s" in warnings[0].getMessage()
    assert engine.tier_stats()["cpu"]["resident_blocks"] == 2
    stats = engine.get_stats()
    assert values(stats, PREFIX + "hints_refused") == {(): 1}
    assert values(stats, PREFIX + "retained_blocks") == {(): 0}


def test_retention_counters_never_go_back_when_their_source_restarts():
    """Under `shared: host` the counters are the owner's: a restarted owner starts them at 0."""
    class Stats:
        def __init__(self):
            self.counters = {}

        def increase_counter(self, name, delta):
            self.counters[name] = self.counters.get(name, 0) + delta

        def set_gauge(self, name, value):
            pass

    last: dict = {}
    stats = Stats()
    record_retention(stats, {"expired": 5, "sessions": 1}, last)
    record_retention(stats, {"expired": 2}, last)  # (restarted: 2 since)
    record_retention(stats, {}, last)  # (the owner did not answer: nothing changed)
    assert stats.counters == {PREFIX + "expired": 7}


def test_the_private_hierarchy_reports_the_same_names(engine):
    """The names the host engine exports are those of `HierarchyManager.get_stats` per tier."""
    from conftest import memory_hierarchy

    h = memory_hierarchy()
    try:
        manager: HierarchyManager = h.manager
        assert {"retained_blocks", "ended_blocks"} <= set(manager.get_stats()["hot"])
        assert set(engine.tier_stats()["engine"]["retention"]) == set(manager.retention.report())
    finally:
        h.close()


def test_one_shot_requests_of_one_session_name_each_count_ended_in_the_owner(engine):
    """The engine sends its request id with the hint, so the owner counts each request that ends
    a session once, not once per session name (before: 1 for 3 requests)."""
    for i in range(3):
        ctx = request(f"q{i}", session="u", session_ended=True)
        stored(engine, keys(2, 10 * i), ctx)
        engine.on_request_finished(ctx)  # (its touch carries the hint too: the same request)
    assert engine.tier_stats()["engine"]["retention"]["ended"] == 3


def test_the_owner_refuses_a_request_id_that_is_no_string(engine):
    from kvtier.host.client import HostRefused

    with pytest.raises(HostRefused, match="request: expected a request id"):
        engine.client.call("touch", keys=[keys(1)[0].hex()], hints={"session": "s", "retain_s": 5},
                           request=["not", "a", "string"])
