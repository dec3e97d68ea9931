"""Without hints a session's chain of blocks leaves the hierarchy from its deep end, never with a
hole in its middle, in every tier, cascade included (issue 40: "keep a live session's chain
together ... in every tier, cascade included").

The tier below a cascading tier orders its copies by when they arrived; a copy made early (the
reserve's background demotions, write-through) used to keep that early place after its block
left the tier above, so the tier below dropped a chain's head copies before its deep end's: 123
holes in the chat workload below (16 at other sizes, 24 in mixed-scans). Eviction from a
cascading tier now makes the clean copies below as recent as a copy made then (`Tier.evict`).
What remains is rare and comes from the first tier's own order (prefix-freq can outlive a turn's
older blocks with its newer head: 3 of 13,605 checks with chat at 150 blocks, write-through).
"""

from __future__ import annotations

import pytest
from conftest import keys

from kvtier import ReqContext, build_hierarchy, load_config_text
from kvtier.bench import replay
from kvtier.bench.sessions import generate_session_trace
from kvtier.core.keys import make_offload_key
from kvtier.core.types import LookupResult
from kvtier.policies.lru_pure import PureLRUCachePolicy


def chain_holes(workload: str, hot: int, warm: int, cascade: str) -> tuple[int, int]:
    """Replay `workload` (a quarter of its sessions) through prefix-freq over an lru tier three
    times larger; every 10 requests, for each session seen so far, whether the blocks of its
    latest turn that the hierarchy still holds are a prefix of that turn. (holes, checks)."""
    trace = generate_session_trace(workload, scale=0.25)
    hierarchy = build_hierarchy(load_config_text(f"""
block_bytes: 64B
tiers:
  - {{name: hot, backend: memory, capacity: {hot} blocks, policy: prefix-freq, cascade: {cascade}}}
  - {{name: warm, backend: memory, capacity: {warm} blocks, policy: lru}}
"""), dry_run=True)
    manager, latest, holes, checks = hierarchy.manager, {}, 0, 0
    try:
        for i, hashes in enumerate(trace.requests):
            keys = [make_offload_key(h.to_bytes(8, "big"), 0) for h in hashes]
            replay.drive(manager, [keys], False, lambda _, i=i: ReqContext(str(i)), None, LookupResult.HIT,
                         LookupResult.MISS, None)
            if trace.sessions[i] is not None:
                latest[trace.sessions[i]] = keys
            if i % 10:
                continue
            for chain in latest.values():
                held = [any(tier.readable(key) is not None for tier in manager.tiers) for key in chain]
                kept = held.index(False) if False in held else len(held)
                holes += any(held[kept:])
                checks += 1
    finally:
        hierarchy.close()
    return holes, checks


def test_a_chain_is_cut_from_its_deep_end_in_every_tier():
    holes, checks = chain_holes("chat", 300, 900, "on_evict")
    assert checks > 10_000 and holes == 0, f"{holes} of {checks} chains had a hole"  # (123 before)


def test_the_tier_below_keeps_the_blocks_that_just_left_the_tier_above():
    """Write-through copies every block below at once; when the tier above evicts A, the copies
    below of A are the ones to keep (B is still above): before, the tier below dropped A's older
    copies for C's and A was lost to the hierarchy while B was held twice."""
    hierarchy = build_hierarchy(load_config_text("""
block_bytes: 64B
tiers:
  - {name: hot, backend: memory, capacity: 4 blocks, policy: lru, cascade: on_store}
  - {name: warm, backend: memory, capacity: 4 blocks, policy: lru}
"""), dry_run=True)
    manager = hierarchy.manager
    a, b, c = keys(2, 0), keys(2, 10), keys(2, 20)
    try:
        for blocks in (a, b, c):  # C's store evicts A above (its copies below are readable)
            out = manager.prepare_store(blocks)
            assert out is not None
            manager.complete_store(out.keys_to_store)
            manager.on_schedule_end(None)  # (the write-through copies start, and land at once)
        where = {key: [t.name for t in manager.tiers if t.readable(key) is not None] for key in a + b + c}
    finally:
        hierarchy.close()
    assert [where[k] for k in a] == [["warm"]] * 2
    assert [where[k] for k in b] == [["hot"]] * 2 and [where[k] for k in c] == [["hot", "warm"]] * 2


class TouchRefusingLRU(PureLRUCachePolicy):
    """An LRU (third-party style) whose `touch` raises."""

    def touch(self, keys):
        if keys:
            raise RuntimeError("this policy refuses touches")


def test_a_policy_below_that_raises_on_the_refresh_leaves_the_tier_above_consistent():
    hierarchy = build_hierarchy(load_config_text("""
block_bytes: 64B
tiers:
  - {name: hot, backend: memory, capacity: 4 blocks, policy: lru, cascade: on_store}
  - {name: warm, backend: memory, capacity: 8 blocks, policy: "test_chains_in_every_tier:TouchRefusingLRU"}
"""), dry_run=True)
    manager, hot = hierarchy.manager, hierarchy.manager.tiers[0]
    try:
        for blocks in (keys(2, 0), keys(2, 10)):
            manager.complete_store(manager.prepare_store(blocks).keys_to_store)
            manager.on_schedule_end(None)
        with pytest.raises(RuntimeError, match="refuses touches"):
            manager.prepare_store(keys(2, 20))  # evicts A above, then the refresh below raises
        assert [hot.readable(k) for k in keys(2, 0)] == [None, None]  # A left, its slots free
        assert len(hot.table) == 2 and hot.backend.get_num_free_blocks() == 2
        out = manager.prepare_store(keys(2, 20))  # the next store finds the room
        assert out is not None and out.evicted_keys == []
    finally:
        hierarchy.close()
