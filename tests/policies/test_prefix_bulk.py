"""prefix-freq's faster batch paths (issue 19 item 1) must change exactly what the key-by-key
rules do: `insert_many` places a batch with returning ghosts in C loops per segment (as `insert`
places them key by key, wherever the tail is and whatever segments the ghosts left), and `touch`
probes the segment of the previous key first (as the fixed probe order: new blocks, hit classes
from the top, tails), with the same stamps, running mean and counters. Both are checked through
the policy's public state (`segs`, `ghosts`, `aside`, `tail_counts`, `clock`, `unit`)."""

from __future__ import annotations

import random

import pytest

from kvtier.core.types import BlockStatus
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.policies.prefix_tails import HIT_NEW, HIT_TAIL


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def per_key(policy: PurePrefixFreqCachePolicy, keys: list, blocks: list, tail) -> None:
    """The per-key rule that `insert_many` must equal: each key inserted alone, in order; `insert`
    places a returning ghost by its history and any other key among the new blocks, and a one-key
    `insert_many(tail=)` puts the tail (when it is not a returning ghost) into the tails."""
    for k, block in zip(keys, blocks):
        if k == tail and k not in policy.ghosts:
            policy.insert_many([k], [block], tail=k)
        else:
            policy.insert(k, block)


def snapshot(policy: PurePrefixFreqCachePolicy) -> tuple:
    return ([list(seg.items()) for seg in policy.segs], list(policy.ghosts.items()), policy.tail_counts,
            sorted(policy.blocks), policy.clock)


@pytest.mark.parametrize("seed", range(10))
def test_insert_many_with_ghosts_equals_place_per_key(seed):
    rng = random.Random(seed)
    bulk, each = PurePrefixFreqCachePolicy(60), PurePrefixFreqCachePolicy(60)
    next_id = 0
    ghost_batches = 0
    for _ in range(400):
        resident = list(bulk.blocks)
        op = rng.random()
        if op < 0.45 or len(resident) < 20:
            ghosts = list(bulk.ghosts)
            fresh = [key(next_id + i) for i in range(rng.randint(0, 12))]
            next_id += len(fresh)
            returning = rng.sample(ghosts, min(len(ghosts), rng.randint(0, 8)))
            ks = fresh + returning
            rng.shuffle(ks)
            if not ks:
                continue
            ghost_batches += bool(returning)
            tail = rng.choice([ks[0], ks[-1], rng.choice(ks), None, key(10**9)])
            for policy, fn in ((bulk, None), (each, per_key)):
                blocks = BlockStatus.many(range(len(ks)))
                for b in blocks:
                    b.ref_cnt = 0
                if fn is None:
                    policy.insert_many(ks, blocks, tail=tail)
                else:
                    fn(policy, ks, blocks, tail if tail is not None and policy.demote_tail else None)
        elif op < 0.7:
            ks = rng.sample(resident, min(len(resident), rng.randint(1, 8)))
            bulk.touch(ks)
            each.touch(ks)
        else:
            n = rng.randint(1, 15)
            a, b = bulk.evict(n, set()), each.evict(n, set())
            assert [k for k, _ in a or ()] == [k for k, _ in b or ()]
        assert snapshot(bulk) == snapshot(each)
    assert ghost_batches > 20


def fixed_probe_order_touch(policy: PurePrefixFreqCachePolicy, keys: list) -> tuple:
    """What `touch(keys)` must leave (as `snapshot`, plus `aside` and `unit`), worked out from the
    policy's public state as `touch` was written before the probe order changed: touched aside keys
    back into their segment, then for each key (last first) new blocks, the hit classes from the top,
    then tails. The clock and stamps are ints here, as they were before `touch` went to float
    arithmetic: the float clock must give the same stamps and running mean.

    Brings the policy's clock up to date first (`touch([])`: the inserts since its last call)."""
    policy.touch([])
    segs = [dict(seg) for seg in policy.segs]  # (dicts keep the order; pops and stores append)
    aside, counts = dict(policy.aside), policy.tail_counts
    clock, unit, rate = int(policy.clock), policy.unit, policy.unit_rate
    top = len(segs) - 1
    for key in keys:
        entry = aside.pop(key, None)
        if entry is not None:
            segs[entry[0]][key] = entry[2]
    for key in reversed(keys):
        for seg in (1, *range(top, 1, -1), 0):
            stamp = segs[seg].pop(key, None)
            if stamp is not None:
                break
        else:
            continue
        counts[HIT_TAIL if seg == 0 else HIT_NEW] += seg <= 1
        clock += 1
        unit += (clock - int(stamp) - unit) * rate
        segs[2 if seg == 0 else min(seg + 1, top)][key] = clock
    assert type(clock) is int
    return ([list(seg.items()) for seg in segs], list(policy.ghosts.items()), counts, sorted(policy.blocks), clock,
            aside, unit)


def check_touch(policy: PurePrefixFreqCachePolicy, keys: list) -> None:
    """`touch(keys)` leaves what the fixed probe order leaves."""
    want = fixed_probe_order_touch(policy, keys)
    policy.touch(keys)
    assert (*snapshot(policy), dict(policy.aside), policy.unit) == want


@pytest.mark.parametrize("seed", range(10))
def test_touch_equals_the_fixed_probe_order(seed):
    rng = random.Random(seed)
    policy = PurePrefixFreqCachePolicy(80)
    next_id = touches = 0
    for _ in range(500):
        resident = list(policy.blocks)
        op = rng.random()
        if op < 0.35 or len(resident) < 20:
            ks = [key(next_id + i) for i in range(rng.randint(1, 10))] + rng.sample(list(policy.ghosts), 1 if
                                                                                    policy.ghosts else 0)
            next_id += 10
            blocks = BlockStatus.many(range(len(ks)))
            for b in blocks:
                b.ref_cnt = 0
            policy.insert_many(ks[::-1], blocks[::-1], tail=ks[-1])
        elif op < 0.8:
            # prefixes of resident keys (runs of segments), other keys, repeats, absent keys
            ks = rng.sample(resident, min(len(resident), rng.randint(1, 25)))
            ks.sort(key=lambda k: -max(i for i, seg in enumerate(policy.segs) if k in seg or i == 0))
            if rng.random() < 0.3:
                ks += [rng.choice(ks), key(10**9)]
            check_touch(policy, ks)
            touches += 1
        else:
            policy.evict(rng.randint(1, 15), set())
    assert touches > 100 and any(policy.segs[-1]) and policy.tail_counts[HIT_NEW] > 0  # (hits of every kind)


@pytest.mark.parametrize("seed", range(8))
def test_touch_with_pins_and_aside_keys_equals_the_fixed_probe_order(seed):
    """Evictable accounting on: evictions set pinned keys aside and `touch` puts them back first,
    so the hit counts that `touch` takes from the tails' and new blocks' sizes include them."""
    rng = random.Random(seed)
    policy = PurePrefixFreqCachePolicy(80)
    policy.evictable((), False)
    next_id = 0
    aside_touches = 0
    for _ in range(500):
        resident = list(policy.blocks)
        op = rng.random()
        if op < 0.3 or len(resident) < 20:
            ks = [key(next_id + i) for i in range(rng.randint(1, 10))]
            next_id += 10
            blocks = BlockStatus.many(range(len(ks)))
            for b in blocks:
                b.ref_cnt = 0
            policy.insert_many(ks[::-1], blocks[::-1], tail=ks[-1])
        elif op < 0.45:
            ks = rng.sample(resident, min(len(resident), rng.randint(1, 6)))
            for k in ks:
                policy.blocks[k].ref_cnt += 1
            policy.evictable(ks, False)
        elif op < 0.55:
            ks = [k for k in resident if policy.blocks[k].ref_cnt][:rng.randint(1, 6)]
            for k in ks:
                policy.blocks[k].ref_cnt -= 1
            policy.evictable([k for k in ks if policy.blocks[k].ref_cnt == 0], True)
        elif op < 0.85:
            ks = rng.sample(resident, min(len(resident), rng.randint(1, 25)))
            aside_touches += not policy.aside.keys().isdisjoint(ks)
            if rng.random() < 0.2:
                ks += [rng.choice(ks), key(10**9)]
            check_touch(policy, ks)
        else:
            protected = set(rng.sample(resident, min(len(resident), rng.randint(0, 3))))
            policy.evict(rng.randint(1, 15), protected)
    assert aside_touches > 10
