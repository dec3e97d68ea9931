"""prefix-freq's `insert_many` places a batch with returning ghosts in C loops per segment
(issue 19 item 1): segments, ghosts and tail evidence must end up exactly as with `_place` key by
key (the rule `insert` applies), wherever the tail is and whatever segments the ghosts left."""

from __future__ import annotations

import random

import pytest

from kvtier.policies.prefix import PrefixFreqCachePolicy
from kvtier.types import BlockStatus


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def per_key(policy: PrefixFreqCachePolicy, keys: list, blocks: list, tail) -> None:
    """The per-key rule that `insert_many` must equal (the `_place` loop)."""
    policy.blocks.update(zip(keys, blocks))
    for k in keys:
        policy._place(k, k == tail)


def snapshot(policy: PrefixFreqCachePolicy) -> tuple:
    return ([list(seg.items()) for seg in policy.segs], list(policy.ghosts.items()), list(policy._tails.counts),
            sorted(policy.blocks), policy.clock)


@pytest.mark.parametrize("seed", range(10))
def test_insert_many_with_ghosts_equals_place_per_key(seed):
    rng = random.Random(seed)
    bulk, each = PrefixFreqCachePolicy(60), PrefixFreqCachePolicy(60)
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
