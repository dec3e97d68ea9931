"""A shorter run of the manager soak (benchmarks.soak) in CI, and regression tests for the
manager bugs it found (bugs 1 and 2 of docs/reliability.md, fixed).

The long run (>= 1,000,000 operations) is documented in docs/reliability.md.
"""

from __future__ import annotations

from conftest import keys, memory_hierarchy

from benchmarks import soak
from kvtier import LookupResult

OPS = 30_000


def test_soak_keeps_every_invariant():
    """Every invariant holds through failing, deferred and raising copies and aborted requests."""
    report = soak.run(OPS, seed=3, check_every=32)
    assert report["ops"] >= OPS
    c, handler = report["counts"], report["handler"]
    # the run really exercised the failure paths it claims to
    assert handler["failed"] > 0 and handler["raised"] > 0 and handler["deferred"] > 0
    assert c["stores_aborted"] > 0 and c["loads_aborted"] > 0 and c["lookup_RETRY"] > 0
    assert report["stats"]["warm"]["promotions"] > 0 and report["stats"]["hot"]["demotions"] > 0


def test_soak_with_a_compiled_first_tier_policy():
    """The invariant check compares a pinned block by its slot: a compiled policy's `get` answers
    with a new view each time (before, every run with `lru` on top failed at once, at op 192)."""
    assert soak.run(20_000, seed=5, check_every=32, hot_policy="lru")["ops"] >= 20_000


def test_soak_with_another_seed_and_no_stores_during_promotion():
    assert soak.run(OPS, seed=4, check_every=32, store_while_promoting=False)["ops"] >= OPS


def _fill(m, ks):
    for k in ks:
        out = m.prepare_store([k])
        m.complete_store(out.keys_to_store)
    m.wait_idle()


def _store_during_queued_promotion() -> int:
    """ref_cnt of a block stored while its promotion from tier 1 was queued, after all jobs ended."""
    h = memory_hierarchy(hot=4, warm=16, block_bytes=64)
    m = h.manager
    ks = keys(8)
    for k in ks:
        out = m.prepare_store([k])
        m.complete_store(out.keys_to_store)
        m.on_schedule_end()
        m.wait_idle()
    k = ks[0]
    assert m.tiers[0].policy.get(k) is None and m.tiers[1].policy.get(k) is not None
    assert m.lookup(k) is LookupResult.RETRY  # promotion queued
    out = m.prepare_store([k])  # another request computed and stores the same block meanwhile
    assert out.keys_to_store == [k]
    m.complete_store(out.keys_to_store)
    m.on_schedule_end()
    m.wait_idle()
    ref_cnt = m.tiers[0].policy.get(k).ref_cnt
    h.close()
    return ref_cnt


def test_store_of_a_block_whose_promotion_is_queued_becomes_readable():
    """Bug 1: the engine's store supersedes a promotion not started yet."""
    assert _store_during_queued_promotion() == 0, "the stored block never became readable"


def _promotion_source_evicted(m):
    a, b, c, d = keys(4)
    _fill(m, (a, b, c, d))
    m.touch([c])  # tier 0: d (dirty) is the next victim; tier 1: b is its next victim
    assert m.lookup(b) is LookupResult.RETRY
    m.on_schedule_end()  # making room demotes d, which evicts b from the tier it is promoted from
    m.wait_idle()
    assert m.lookup(b) in (LookupResult.HIT, LookupResult.MISS)


def test_promotion_whose_source_would_be_evicted_while_making_room():
    """Bug 2: the source of a queued promotion is pinned before tier 0 makes room (which demotes
    into, and so evicts from, that same tier)."""
    h = memory_hierarchy(hot=2, warm=2, block_bytes=64, reserve=0.01)
    _promotion_source_evicted(h.manager)
    h.close()
