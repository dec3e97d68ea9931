"""prefix-freq's eviction takes long runs of a lane in C-loop chunks (issue 19 item 1); what it
evicts must stay exactly the order `victims` names (the key-by-key merge), less the
protected blocks, with protected and pinned blocks inside the runs, with and without evictable
accounting."""

from __future__ import annotations

import random

import pytest

from kvtier.core.types import BlockStatus
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


@pytest.mark.parametrize("tracked", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_evict_equals_the_order_walk(seed, tracked):
    rng = random.Random(seed)
    policy = PurePrefixFreqCachePolicy(400)
    if tracked:
        policy.evictable((), False)
    blocks: dict[bytes, BlockStatus] = {}
    next_id = 0
    long_runs = 0
    for _ in range(1500):
        op = rng.random()
        resident = list(blocks)
        if op < 0.35 or len(resident) < 50:
            ks = [key(next_id + i) for i in range(rng.randint(1, 40))]
            next_id += len(ks)
            new = BlockStatus.many(range(len(ks)))
            for b in new:
                b.ref_cnt = 0
            blocks.update(zip(ks, new))
            policy.insert_many(ks[::-1], new[::-1], tail=ks[-1])
        elif op < 0.55:
            policy.touch(rng.sample(resident, rng.randint(1, min(30, len(resident)))))
        elif op < 0.7:  # pin or unpin a few
            for k in rng.sample(resident, rng.randint(1, 5)):
                block = blocks[k]
                block.ref_cnt = 0 if block.ref_cnt else 1
                policy.evictable([k], not block.ref_cnt)
        else:
            n = rng.randint(1, 60)
            protected = set(rng.sample(resident, rng.randint(0, 6)))
            want = policy.victims(n, protected)
            got = policy.evict(n, protected)
            if len(want) < n:
                assert got is None
                continue
            assert got is not None and [k for k, _ in got] == want
            long_runs += n >= 20
            for k, _ in got:
                del blocks[k]
        assert len(policy) == len(blocks)
    assert long_runs > 20
