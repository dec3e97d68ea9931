"""vLLM asks the adapter's `get_stats` every scheduler step: its cost must not grow with the blocks
sessions' hints retain. It used to look every retained block up in every tier at each call (9 ms
a step at 10,000 retained blocks, 120 ms at 50,000); the tiers' `retained_blocks` are now
recounted at most once a second (`RECOUNT_S`), one C loop per tier (`BlockTable.absent`), and
`HierarchyManager.get_stats` itself counts them exactly, the same way. The tests count recounts
on a fake clock; they time nothing."""

from __future__ import annotations

import time

import pytest
from conftest import keys, memory_hierarchy

from kvtier import ReqContext

pytest.importorskip("vllm")

from kvtier.integrations.vllm.manager import KVTierOffloadingManager  # noqa: E402

HOT = 20_000  # blocks of the first tier: 10,000 retained (its share)
RECOUNT_S = 1.0  # (`retention_metrics.RECOUNT_S`)


def hinted(name, session):
    return ReqContext(name, kv_transfer_params={"kvtier": {"session": session, "retain_s": 600}})


@pytest.fixture(scope="module")
def retained():
    h = memory_hierarchy(hot=HOT, warm=2 * HOT, cascade="on_evict", block_bytes=16)
    m = h.manager
    for s in range(HOT // 2000):
        ctx = hinted(f"r{s}", f"s{s}")
        out = m.prepare_store(keys(1000, s * 1000), ctx)
        m.complete_store(out.keys_to_store, ctx)
    m.wait_idle(30)
    assert len(m.retention.retained) == HOT // 2
    yield h
    h.close()


def gauge(stats, tier):
    return stats.data["data"]["vllm:kvtier_retained_blocks"][(tier,)]


def test_the_adapter_recounts_retained_blocks_at_most_once_a_period(retained, monkeypatch):
    """Counted, not timed: of 50 steps within one period, one looks the retained blocks up."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm import retention_metrics

    clock = [1000.0]
    monkeypatch.setattr(retention_metrics, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    manager, recounts = retained.manager, []
    full = manager.get_stats

    def counted(retained=True):
        recounts.append(retained)
        return full(retained=retained)

    monkeypatch.setattr(manager, "get_stats", counted)
    adapter = KVTierOffloadingManager(retained)
    held = len(manager.retention.retained)
    assert held >= HOT // 4
    for _ in range(50):  # (0.5 s of steps)
        stats = adapter.get_stats()
        assert gauge(stats, "hot") == held and gauge(stats, "warm") == 0
        clock[0] += 0.01
    assert recounts.count(True) == 1, recounts.count(True)
    clock[0] += RECOUNT_S
    assert gauge(adapter.get_stats(), "hot") == held
    assert recounts.count(True) == 2


def test_the_adapters_retained_gauge_follows_within_a_recount_period(retained):
    adapter = KVTierOffloadingManager(retained)
    m = retained.manager
    held = len(m.retention.retained)
    assert gauge(adapter.get_stats(), "hot") == held
    m.touch(keys(1000, 0), ReqContext("end", kv_transfer_params={"kvtier": {"session": "s0", "retain_s": 0}}))
    assert adapter.tier_stats()["hot"]["retained_blocks"] == held - 1000  # (exact every time)
    time.sleep(RECOUNT_S + 0.05)
    assert gauge(adapter.get_stats(), "hot") == held - 1000
    m.touch(keys(1000, 0), hinted("again", "s0"))  # (retained again, for the other tests)
    assert len(m.retention.retained) == held


def test_the_managers_own_count_is_exact_every_call(retained):
    m = retained.manager
    rows = m.get_stats()
    assert rows["hot"]["retained_blocks"] == len(m.retention.retained) and rows["warm"]["retained_blocks"] == 0
    assert "retained_blocks" not in m.get_stats(retained=False)["hot"]
