"""ARC's adaptation (Megiddo & Modha, FAST'03) on crafted sequences, and the distinguishing
behaviour of kvtier's other policies: SIEVE (NSDI'24) and prefix-freq (docs/policies.md)."""

from __future__ import annotations

import pytest

from kvtier import make_offload_key
from kvtier.core.types import BlockStatus
from kvtier.policies.arc import ARCCachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.policies.sieve import SIEVECachePolicy


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ready(i: int = 0) -> BlockStatus:
    block = BlockStatus(i)
    block.ref_cnt = 0
    return block


def insert(policy, ids) -> None:
    for i in ids:
        policy.insert(key(i), ready(i))


def evicted(victims) -> list[int]:
    return [int.from_bytes(k[:8], "big") for k, _ in victims]


# ------------------------------------------------------------------ ARC
def test_arc_ghost_hit_in_b1_grows_target_t1():
    arc = ARCCachePolicy(4)
    insert(arc, range(4))  # all in T1
    assert evicted(arc.evict(2, set())) == [0, 1]  # target 0: T1 gives first
    assert list(arc.b1) == [key(0), key(1)] and not arc.b2
    assert arc.target_t1_size == 0
    arc.insert(key(0), ready())  # a ghost hit in B1: T1 was too small
    assert arc.target_t1_size == 1  # + max(1, |B2|/|B1|) = 1
    assert key(0) in arc.t2 and key(0) not in arc.b1


def test_arc_ghost_hit_in_b2_shrinks_target_t1():
    arc = ARCCachePolicy(4)
    insert(arc, range(4))
    arc.evict(2, set())  # 0, 1 -> B1
    arc.insert(key(0), ready())  # B1 hit: p = 1, 0 -> T2
    arc.insert(key(1), ready())  # B1 hit: p = 2, 1 -> T2
    assert arc.target_t1_size == 2
    arc.touch([key(2), key(3)])  # 2, 3 -> T2; T1 empty
    assert not arc.t1 and len(arc.t2) == 4
    victims = arc.evict(1, set())
    assert evicted(victims) == [0]  # T1 is empty: T2's LRU goes, to B2
    assert key(0) in arc.b2
    arc.insert(key(0), ready())  # B2 hit: T2 was too small
    assert arc.target_t1_size == 1  # - max(1, |B1|/|B2|) = 1
    assert key(0) in arc.t2


def test_arc_target_grows_faster_when_b2_is_larger():
    arc = ARCCachePolicy(8)
    insert(arc, range(8))
    arc.touch([key(i) for i in range(4, 8)])  # 4..7 -> T2
    arc.evict(4, set())  # T1 (0..3) -> B1 since p = 0
    arc.target_t1_size = 8.0  # now prefer T1: T2 gives victims
    insert(arc, range(100, 104))
    arc.evict(3, set())
    assert len(arc.b2) >= 2
    before = arc.target_t1_size = 0.0
    ratio = max(1.0, len(arc.b2) / len(arc.b1))
    arc.insert(key(0), ready())  # B1 hit
    assert arc.target_t1_size == before + ratio


def test_arc_ghost_lists_bounded_by_capacity():
    c = 8
    arc = ARCCachePolicy(c)
    for i in range(500):
        if len(arc) >= c:
            assert arc.evict(1, set()) is not None
        arc.insert(key(i % 37), ready(i)) if arc.get(key(i % 37)) is None else arc.touch([key(i % 37)])
        if i % 3 == 0:
            arc.touch([key((i * 7) % 37)])
        assert len(arc.t1) + len(arc.b1) <= c
        assert len(arc.b1) + len(arc.b2) <= c
        assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 2 * c
        assert 0 <= arc.target_t1_size <= c


def test_arc_clear_forgets_ghosts_and_target():
    arc = ARCCachePolicy(4)
    insert(arc, range(4))
    arc.evict(2, set())
    arc.insert(key(0), ready())
    arc.clear()
    assert not arc.b1 and not arc.b2 and arc.target_t1_size == 0 and len(arc) == 0


# ------------------------------------------------------------------ SIEVE
def test_sieve_visited_block_survives_one_pass_without_moving():
    sieve = SIEVECachePolicy(8)
    insert(sieve, range(8))
    sieve.touch([key(0)])
    assert evicted(sieve.evict(1, set())) == [1]  # the hand skips 0 (and clears its bit)
    insert(sieve, [8])
    assert evicted(sieve.evict(1, set())) == [2]
    # 0 was not moved: the hand goes on to the newest block, then wraps to 0 (bit cleared).
    assert evicted(sieve.evict(6, set())) == [3, 4, 5, 6, 7, 8]
    assert evicted(sieve.evict(1, set())) == [0]


def test_sieve_scan_does_not_flush_reused_blocks():
    """One-time blocks keep flowing; blocks reused between two passes of the hand stay."""
    sieve = SIEVECachePolicy(16)
    hot = list(range(4))
    insert(sieve, hot)
    for i in range(100, 400):
        if len(sieve) >= 16:
            sieve.evict(1, set())
        insert(sieve, [i])
        if i % 8 == 0:  # reused at least once per turn of the hand (12 one-time slots)
            sieve.touch([key(h) for h in hot])
    assert all(sieve.get(key(h)) is not None for h in hot)
    assert sieve.evict(1, set())[0][0] not in {key(h) for h in hot}


# ------------------------------------------------------------------ prefix-freq
def request(policy, hits, new, capacity):
    """What the manager does for one request: touch hits, make room, insert new blocks tail first
    and say which one is the request's tail."""
    if hits:
        policy.touch([key(i) for i in hits])
    need = len(policy) + len(new) - capacity
    if need > 0:
        assert policy.evict(need, {key(i) for i in new}) is not None
    policy.insert_many([key(i) for i in reversed(new)], [ready(i) for i in reversed(new)],
                       tail=key(new[-1]) if new else None)


def conversations(policy, cap, turns, resend_tail, first=0, count=40):
    """Multi-turn traffic: each turn re-sends its conversation's history (with or without the
    previous request's last block, the tail) and adds 3 blocks."""
    convs = [[c * 1000 + i for i in range(3)] for c in range(first, first + count)]
    for turn in range(turns):
        for c, chain in enumerate(convs):
            sent = chain if resend_tail else chain[:-1]
            prefix = []
            for h in sent:
                if policy.get(key(h)) is None:
                    break
                prefix.append(h)
            added = [(first + c) * 1000 + 3 * (turn + 1) + i for i in range(3)]
            new_blocks = sent[len(prefix):] + added
            request(policy, prefix, new_blocks, cap)
            convs[c] = sent + added


def with_one_time_tails(policy, requests: int = 64):
    """Traffic whose departures prove request tails one-time: `requests` requests of two new blocks whose
    head is hit while resident and whose tail is evicted unused, in batches that fit the tier,
    each emptied after it (tails first). Ids from 5000 on (the tests use lower ones)."""
    cap = policy.cache_capacity
    per_batch = min(32, cap // 2)
    done = 0
    while done < requests:
        batch = min(per_batch, requests - done)
        for r in range(done, done + batch):
            request(policy, [], [5000 + 2 * r, 5001 + 2 * r], cap)
            policy.touch([key(5000 + 2 * r)])
        assert all(i % 2 for i in evicted(policy.evict(batch, set()))), "the unused tails leave first"
        assert policy.evict(len(policy), set()) is not None
        done += batch
    assert demotes_tails(policy)
    return policy


def demotes_tails(policy) -> bool:
    """Whether `policy` now evicts a new request's tail before an older request's new block
    (prefix-freq's rule while tails look one-time), asked through the contract: two requests
    go in (evicting up to 4 blocks if the tier is full) and their blocks are removed again."""
    cap = policy.cache_capacity
    policy.touch([])
    request(policy, [], [90_000, 90_001], cap)  # 90_000: an ordinary new block
    policy.touch([])
    request(policy, [], [90_002, 90_003], cap)  # 90_003: the newest request's tail
    order = [int.from_bytes(k[:8], "big") for k in policy.victims(len(policy))]
    answer = order.index(90_003) < order.index(90_000)
    for i in range(90_000, 90_004):
        policy.remove(key(i))
    return answer


def test_prefix_freq_tail_first_then_chains_from_the_deep_end():
    policy = with_one_time_tails(PurePrefixFreqCachePolicy(100))
    request(policy, [], [0, 1, 2, 3, 4], 100)  # chain A, tail 4
    request(policy, [], [10, 11, 12], 100)  # chain B, tail 12 (no other call in between: told, not inferred)
    policy.touch([])
    request(policy, [], [20, 21, 22], 100)
    order = [int.from_bytes(k[:8], "big") for k in policy.victims(len(policy))]
    assert order[:3] == [4, 12, 22]  # request tails go first
    assert order.index(11) < order.index(10)  # B: deepest first
    assert order.index(3) < order.index(2) < order.index(1) < order.index(0)  # deepest first
    assert order.index(21) < order.index(20)


def test_prefix_freq_takes_the_tail_it_is_told_and_no_other():
    """Blocks inserted without `tail` (copies from another tier, such as a promoted prefix) hold
    no tail even right after a touch; a tail passed explicitly is one even with no call before."""
    policy = with_one_time_tails(PurePrefixFreqCachePolicy(100))
    policy.touch([])
    policy.insert_many([key(30), key(31)], [ready(30), ready(31)])  # a promoted prefix, head first
    request(policy, [], [40, 41], 100)
    request(policy, [], [50, 51], 100)
    order = [int.from_bytes(k[:8], "big") for k in policy.victims(len(policy))]
    assert order[:2] == [41, 51]  # only the tails that were named go first
    assert order.index(31) > 1 and order.index(30) > 1


def test_prefix_freq_scan_does_not_flush_a_reused_prefix():
    """A prefix hit a few times survives a burst of one-time requests that flushes it from LRU."""
    cap = 40
    results = {}
    for cls in (PurePrefixFreqCachePolicy, PureLRUCachePolicy):
        policy = cls(cap)
        hot = [0, 1, 2, 3, 4]
        request(policy, [], hot + [5], cap)
        for _ in range(3):
            request(policy, hot, [], cap)
        nxt = 1000
        for _ in range(12):  # 12 requests of 6 one-time blocks: 72 blocks through a 40-block tier
            request(policy, [], list(range(nxt, nxt + 6)), cap)
            nxt += 6
        results[cls.__name__] = all(policy.get(key(h)) is not None for h in hot)
    assert results == {"PurePrefixFreqCachePolicy": True, "PureLRUCachePolicy": False}


def test_prefix_freq_ghost_memory_is_bounded():
    """Ghosts (evicted keys) stay between 1x and 2x `ghost_limit`: 6 capacities, at most 4M keys."""
    assert PurePrefixFreqCachePolicy(1000).ghost_limit == 6000
    assert PurePrefixFreqCachePolicy(10_000_000).ghost_limit == 4_000_000
    cap = 4
    policy = PurePrefixFreqCachePolicy(cap)
    policy.max_ghost_limit = 10
    policy.ghost_limit = min(policy.ghost_limit, policy.max_ghost_limit)
    sizes = []
    for i in range(200):
        request(policy, [], [i], cap)
        sizes.append(len(policy.ghosts))
    assert max(sizes) < 2 * policy.ghost_limit and sizes[-1] >= policy.ghost_limit


def test_prefix_freq_restored_ghost_counts_as_a_hit():
    cap = 10
    policy = PurePrefixFreqCachePolicy(cap)
    request(policy, [], list(range(10)), cap)
    policy.evict(10, set())  # all become ghosts
    request(policy, [], [3], cap)  # 3 comes back: it was needed, so it is treated as hit once
    request(policy, [], list(range(100, 109)), cap)  # fresh blocks, stored after 3
    order = [int.from_bytes(k[:8], "big") for k in policy.victims(len(policy))]
    assert order[-1] == 3  # outlives blocks that are newer but never needed twice


def test_prefix_freq_demotes_tails_only_once_departures_show_them_one_time():
    """Tails are ordinary new blocks until measured; traffic that never re-sends a tail turns
    demotion on, traffic that re-sends them (full last blocks) turns it off again."""
    cap = 30
    policy = PurePrefixFreqCachePolicy(cap)
    assert not demotes_tails(policy)  # no evidence yet
    policy = PurePrefixFreqCachePolicy(cap)
    conversations(policy, cap, turns=6, resend_tail=False)
    assert demotes_tails(policy)
    conversations(policy, cap, turns=5, resend_tail=True, first=100)
    assert not demotes_tails(policy)


@pytest.mark.parametrize("one_time", [True, False])
def test_prefix_freq_victims_is_the_evict_order_with_and_without_tail_demotion(one_time):
    """Tails first (one-time) or tails merged as ordinary new blocks: either way `evict` takes
    exactly the blocks `victims` names, in that order, with pinned/hit blocks mixed in."""
    import random

    rng = random.Random(7)
    for _trial in range(20):
        cap = 40
        policy = PurePrefixFreqCachePolicy(cap)
        if one_time:  # evidence enough that the random hits below do not outweigh it
            with_one_time_tails(policy, requests=400)
        nxt = 0
        for _ in range(30):
            resident = list(policy.keys())
            hits = rng.sample(resident, min(len(resident), rng.randint(0, 4)))
            if hits:
                policy.touch(hits)
            new = list(range(nxt, nxt + rng.randint(1, 6)))
            nxt += len(new)
            request(policy, [], new, cap)
        assert demotes_tails(policy) is one_time
        order = policy.victims(len(policy))
        if one_time and policy.segs[0]:
            assert order[0] in policy.segs[0]  # demoted tails lead
        n = rng.randint(1, len(order))
        victims = policy.evict(n, set())
        assert [k for k, _ in victims] == order[:n]
        if one_time:
            assert policy.victims(len(policy)) == order[n:]
