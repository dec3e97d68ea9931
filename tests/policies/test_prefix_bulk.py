"""prefix-freq's faster batch paths (issue 19 item 1) must change exactly what the key-by-key
rules do: `insert_many` places a batch with returning ghosts in C loops per segment (as `_place`
key by key, wherever the tail is and whatever segments the ghosts left), and `touch` probes the
segment of the previous key first (as the fixed probe order: new blocks, hit classes from the
top, tails), with the same stamps, running mean and counters."""

from __future__ import annotations

import random

import pytest

from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.policies.prefix_tails import HIT_NEW, HIT_TAIL
from kvtier.types import BlockStatus


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def per_key(policy: PurePrefixFreqCachePolicy, keys: list, blocks: list, tail) -> None:
    """The per-key rule that `insert_many` must equal (the `_place` loop)."""
    policy.blocks.update(zip(keys, blocks))
    for k in keys:
        policy._place(k, k == tail)


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


def int_clock_policy(capacity: int) -> PurePrefixFreqCachePolicy:
    """A policy whose clock and stamps are ints, as they were before `touch` went to float
    arithmetic: the float clock must give the same stamps, running mean and evictions."""
    policy = PurePrefixFreqCachePolicy(capacity)
    policy.clock = 0
    return policy


def touch_reference(policy: PurePrefixFreqCachePolicy, keys: list) -> None:
    """`touch` as it was written before the probe order changed (new blocks, then the hit
    classes from the top, then tails, for every key), on a policy made by `int_clock_policy`."""
    clock, unit, rate = policy._sync(), policy.unit, policy.unit_rate
    top = len(policy.segs) - 1
    if policy.aside and not policy.aside.keys().isdisjoint(keys):
        policy._aside.unaside(keys)
    for key in reversed(keys):
        for seg in (1, *range(top, 1, -1), 0):
            stamp = policy.segs[seg].pop(key, None)
            if stamp is not None:
                break
        else:
            continue
        policy._tails.counts[HIT_TAIL if seg == 0 else HIT_NEW] += seg <= 1
        clock += 1
        unit += (clock - stamp - unit) * rate
        policy.segs[2 if seg == 0 else min(seg + 1, top)][key] = clock
    policy.clock, policy.unit = clock, unit


@pytest.mark.parametrize("seed", range(10))
def test_touch_equals_the_fixed_probe_order(seed):
    rng = random.Random(seed)
    fast, slow = PurePrefixFreqCachePolicy(80), int_clock_policy(80)
    next_id = 0
    for _ in range(500):
        resident = list(fast.blocks)
        op = rng.random()
        if op < 0.35 or len(resident) < 20:
            ks = [key(next_id + i) for i in range(rng.randint(1, 10))] + rng.sample(list(fast.ghosts), 1 if
                                                                                  fast.ghosts else 0)
            next_id += 10
            for policy in (fast, slow):
                blocks = BlockStatus.many(range(len(ks)))
                for b in blocks:
                    b.ref_cnt = 0
                policy.insert_many(ks[::-1], blocks[::-1], tail=ks[-1])
        elif op < 0.8:
            # prefixes of resident keys (runs of segments), other keys, repeats, absent keys
            ks = rng.sample(resident, min(len(resident), rng.randint(1, 25)))
            ks.sort(key=lambda k: -max(i for i, seg in enumerate(fast.segs) if k in seg or i == 0))
            if rng.random() < 0.3:
                ks += [rng.choice(ks), key(10**9)]
            fast.touch(ks)
            touch_reference(slow, ks)
        else:
            n = rng.randint(1, 15)
            a, b = fast.evict(n, set()), slow.evict(n, set())
            assert [k for k, _ in a or ()] == [k for k, _ in b or ()]
        assert snapshot(fast) == snapshot(slow) and fast.unit == slow.unit
        assert type(slow.clock) is int


@pytest.mark.parametrize("seed", range(8))
def test_touch_with_pins_and_aside_keys_equals_the_fixed_probe_order(seed):
    """Evictable accounting on: evictions set pinned keys aside and `touch` puts them back first,
    so the hit counts that `touch` takes from the tails' and new blocks' sizes include them."""
    rng = random.Random(seed)
    fast, slow = PurePrefixFreqCachePolicy(80), int_clock_policy(80)
    fast.track_pins()
    slow.track_pins()
    next_id = 0
    aside_touches = 0
    for _ in range(500):
        resident = list(fast.blocks)
        op = rng.random()
        if op < 0.3 or len(resident) < 20:
            ks = [key(next_id + i) for i in range(rng.randint(1, 10))]
            next_id += 10
            for policy in (fast, slow):
                blocks = BlockStatus.many(range(len(ks)))
                for b in blocks:
                    b.ref_cnt = 0
                policy.insert_many(ks[::-1], blocks[::-1], tail=ks[-1])
        elif op < 0.45:
            ks = rng.sample(resident, min(len(resident), rng.randint(1, 6)))
            for policy in (fast, slow):
                for k in ks:
                    policy.blocks[k].ref_cnt += 1
                policy.pin(ks)
        elif op < 0.55:
            ks = [k for k in resident if fast.blocks[k].ref_cnt][:rng.randint(1, 6)]
            for policy in (fast, slow):
                for k in ks:
                    policy.blocks[k].ref_cnt -= 1
                policy.unpin([k for k in ks if policy.blocks[k].ref_cnt == 0])
        elif op < 0.85:
            ks = rng.sample(resident, min(len(resident), rng.randint(1, 25)))
            aside_touches += not fast.aside.keys().isdisjoint(ks)
            if rng.random() < 0.2:
                ks += [rng.choice(ks), key(10**9)]
            fast.touch(ks)
            touch_reference(slow, ks)
        else:
            n = rng.randint(1, 15)
            protected = set(rng.sample(resident, min(len(resident), rng.randint(0, 3))))
            a, b = fast.evict(n, protected), slow.evict(n, protected)
            assert [k for k, _ in a or ()] == [k for k, _ in b or ()]
        assert snapshot(fast) == snapshot(slow) and fast.unit == slow.unit
        assert type(slow.clock) is int
        assert dict(fast.aside) == dict(slow.aside)
    assert aside_touches > 10
