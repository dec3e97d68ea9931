"""Evictable accounting (the block table's `CachePolicy.evictable` notices, issue 19 item 2): a
refused eviction does not look at the pinned blocks, LRU takes pinned blocks out of its order,
and decisions stay those of the policy without accounting.

Cost is observed by counting reads of `ref_cnt` (not by timing): `CountingBlock` counts them, for
the policies that keep the inserted objects. `lru` is the compiled index here (its `get` returns
views: blocks are changed through `get`), `lru-py` the pure-Python `PureLRUCachePolicy`."""

from __future__ import annotations

import random

import pytest
from seed_policy import SeedLRUPolicy

from kvtier.core.types import BlockStatus
from kvtier.policies.base import with_key_index
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.testing.policy import key
from kvtier.transfer import registry
from tests.support.policy_state import evictable_count_of

READS = [0]


class CountingBlock(BlockStatus):
    """A BlockStatus whose `ref_cnt` reads are counted in READS[0]."""

    @property  # type: ignore[override]
    def ref_cnt(self) -> int:
        READS[0] += 1
        return BlockStatus.ref_cnt.__get__(self)  # type: ignore[attr-defined]

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        BlockStatus.ref_cnt.__set__(self, value)  # type: ignore[attr-defined]


POLICIES = ["lru", "lru-py", "arc", "sieve", "prefix-freq", "prefix-freq-py"]


def make(name: str, capacity: int):
    if name == "seed":
        return with_key_index(SeedLRUPolicy(capacity))
    if name == "lru-py":
        return PureLRUCachePolicy(capacity)
    if name == "prefix-freq-py":
        return PurePrefixFreqCachePolicy(capacity)
    return with_key_index(registry.resolve(registry.POLICIES, name)(capacity))


def filled(name: str, n: int, pinned: int):
    """A tracking policy holding n blocks, the oldest `pinned` of them pinned (ref_cnt 1)."""
    policy = make(name, n)
    for i in range(n):
        block = CountingBlock(i)
        block.ref_cnt = 1 if i < pinned else 0
        policy.insert(key(i), block)
    policy.evictable((), False)
    return policy


@pytest.mark.parametrize("name", POLICIES + ["seed"])
def test_refusal_reads_no_pinned_block(name):
    policy = filled(name, 5000, pinned=5000)
    READS[0] = 0
    for _ in range(3):
        assert policy.evict(4, set()) is None
    assert READS[0] == 0
    assert evictable_count_of(policy) == 0


@pytest.mark.parametrize("name", POLICIES + ["seed"])
def test_refusal_counts_protected_blocks(name):
    policy = filled(name, 100, pinned=97)
    protected = {key(98)}
    assert evictable_count_of(policy, protected) == 2
    assert policy.evict(3, protected) is None
    assert sorted(k for k, _ in policy.evict(2, protected)) == sorted([key(97), key(99)])


@pytest.mark.parametrize("name", POLICIES + ["seed"])
def test_unpinned_blocks_are_evicted_after_a_refusal(name):
    policy = filled(name, 200, pinned=200)
    assert policy.evict(2, set()) is None
    for i in (5, 150):
        policy.get(key(i)).ref_cnt = 0
    policy.evictable([key(5), key(150)], True)
    assert sorted(k for k, _ in policy.evict(2, set())) == sorted([key(5), key(150)])
    assert len(policy) == 198


def test_lru_scans_pinned_head_once():
    """The oldest 5000 blocks pinned: the first eviction sets them aside, later ones do not read them
    (counted on `PureLRUCachePolicy`'s objects; the compiled index makes the same decisions, see
    tests/policies/test_compact_lru.py)."""
    policy = filled("lru-py", 10_000, pinned=5000)
    assert [k for k, _ in policy.evict(2, set())] == [key(5000), key(5001)]
    READS[0] = 0
    for i in range(10):
        assert [k for k, _ in policy.evict(2, set())] == [key(5002 + 2 * i), key(5003 + 2 * i)]
    assert READS[0] < 100


@pytest.mark.parametrize("name", ["lru", "lru-py"])
def test_lru_unpinned_aside_block_keeps_its_place(name):
    """A block set aside while pinned is, once unpinned, evicted before every newer block."""
    policy = filled(name, 10, pinned=3)
    assert [k for k, _ in policy.evict(1, set())] == [key(3)]
    policy.get(key(1)).ref_cnt = 0
    policy.evictable([key(1)], True)
    assert policy.victims(len(policy))[:2] == [key(1), key(4)]
    assert [k for k, _ in policy.evict(2, set())] == [key(1), key(4)]
    policy.touch([key(0)])  # touched while pinned: back in the order, newest
    policy.get(key(0)).ref_cnt = 0
    policy.evictable([key(0)], True)
    assert policy.victims(len(policy))[-1] == key(0)


@pytest.mark.parametrize("name", POLICIES + ["seed"])
@pytest.mark.parametrize("seed", range(8))
def test_decisions_equal_the_policy_without_accounting(name, seed):
    """Random inserts (single, and requests inserted tail first with their tail named), touches,
    pins, unpins, removes and evictions: a tracking policy evicts exactly what the same policy
    without accounting evicts, and predicts the same order."""
    rng = random.Random(seed)
    plain, tracked = make(name, 64), make(name, 64)
    tracked.evictable((), False)
    blocks: dict = {}
    twins: dict = {}
    next_id = aside_seen = 0
    for _ in range(1500):
        op = rng.random()
        resident = list(blocks)
        if op < 0.3 or not resident:
            ks = [key(next_id + i) for i in range(rng.randint(1, 4))]
            next_id += len(ks)
            writing = rng.random() < 0.3
            for policy, table in ((plain, blocks), (tracked, twins)):
                new = [BlockStatus(next_id) for _ in ks]
                for k, block in zip(ks, new):
                    block.ref_cnt = -1 if writing else 0
                    table[k] = block
                if len(ks) == 1:
                    policy.insert(ks[0], new[0])
                else:
                    policy.insert_many(ks, new, tail=ks[0])
            if writing:
                tracked.evictable(ks, False)
        elif op < 0.45:
            ks = rng.sample(resident, min(len(resident), rng.randint(1, 5)))
            plain.touch(ks)
            tracked.touch(ks)
        elif op < 0.65:
            k = rng.choice(resident)
            if plain.get(k).ref_cnt >= 0:  # (through get: a policy's views, or the objects inserted)
                plain.get(k).ref_cnt += 1
                tracked.get(k).ref_cnt += 1
                tracked.evictable([k], False)
        elif op < 0.8:
            k = rng.choice(resident)
            if plain.get(k).ref_cnt != 0:
                value = 0 if plain.get(k).ref_cnt == -1 else plain.get(k).ref_cnt - 1
                plain.get(k).ref_cnt = tracked.get(k).ref_cnt = value
                if value == 0:
                    tracked.evictable([k], True)
        elif op < 0.85:
            k = rng.choice(resident)
            plain.remove(k)
            tracked.remove(k)
            del blocks[k], twins[k]
        else:
            n = rng.randint(1, 6)
            protected = set(rng.sample(resident, min(len(resident), rng.randint(0, 3))))
            a, b = plain.evict(n, protected), tracked.evict(n, protected)
            assert (a is None) == (b is None)
            assert [k for k, _ in a or ()] == [k for k, _ in b or ()]
            for k, _ in a or ():
                del blocks[k], twins[k]
        order = tracked.victims(len(tracked))
        assert plain.victims(len(plain)) == order
        for n in (1, 2, 7, len(order) + 1):  # the bulk head of the order (`_dirty_victims`) is its head
            assert tracked.victims(n) == order[:n]
        assert sorted(plain.keys()) == sorted(tracked.keys())
        aside_seen = max(aside_seen, len(getattr(tracked, "aside", ())))
    if name in ("lru-py", "prefix-freq", "prefix-freq-py"):
        assert aside_seen, "the run never set a pinned block aside"


@pytest.mark.parametrize("name", ["lru", "lru-py"])
@pytest.mark.parametrize("blocker", ["pinned", "protected"])
def test_lru_head_that_may_not_go_is_put_back_in_order(blocker, name):
    """LRU takes the order's head off in one pass and puts it back when one of those blocks
    may not go: the order afterwards is exactly what it would be had the head not been taken."""
    policy = filled(name, 12, pinned=0)
    protected: set = set()
    if blocker == "pinned":
        policy.get(key(2)).ref_cnt = 1
        policy.evictable([key(2)], False)
    else:
        protected = {key(2)}
    assert [k for k, _ in policy.evict(4, protected)] == [key(0), key(1), key(3), key(4)]
    order = policy.victims(len(policy))
    # A protected block met is set aside, free: it goes first next time (it is the oldest).
    assert order == ([key(2)] if blocker == "protected" else []) + [key(i) for i in range(5, 12)]
    assert [k for k, _ in policy.evict(2, set())] == order[:2]
