"""`PolicyTests`: the `CachePolicy` contract as a pytest suite a third-party policy subclasses.

    # test_my_policy.py
    from kvtier.testing.policy import PolicyTests
    from my_package import MyPolicy

    class TestMyPolicy(PolicyTests):
        policy_factory = MyPolicy          # or override make_policy(self, capacity)
        predicts_victims = False           # if victims() names none

The clauses it checks are `kvtier.testing.policy_contract.POLICY_CLAUSES` (listed in the README);
every failure message starts with the clause that was broken, e.g. `evict(0) and evict(-1) must
return [] and change nothing: evict(-1) returned None`. A policy that raises where the contract
allows no exception fails with the clause and the exception.

Everything is observed through the public contract only (`kvtier.testing.policy_helpers`). "Changes
nothing" is checked twice: the observable state is the same afterwards, and a twin policy that
never saw the call makes the same decisions from then on. A policy written to vLLM's five methods
(no `keys`/`len`/`clear`) is completed by `with_key_index` first, as `build_hierarchy` does.

A policy whose `get` returns views of its own state (`CachePolicy.returns_views`) is checked by
value (`block_id`, `ref_cnt`) where others are checked by identity, and its blocks' `ref_cnt` is
changed through `get`, as the manager does.

Needs pytest and hypothesis; uses no fixture and no conftest of the kvtier repository.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from kvtier.policies.base import CachePolicy, with_key_index
from kvtier.testing import policy_contract as contract
from kvtier.testing.clauses import call
from kvtier.testing.policy_eviction import EvictionTests
from kvtier.testing.policy_helpers import (
    fill,
    key,
    observe,
    probe,
    ready,
    same_block,
)

__all__ = ["PolicyTests", "fill", "key", "ready"]


class PolicyTests(EvictionTests):
    """Subclass as `class TestMine(PolicyTests)` and set `policy_factory` (a callable taking the
    capacity in blocks) or override `make_policy`.

    Declarations a policy may change:
    - `predicts_victims`: `victims(n, skip)` names the evictable blocks in `evict`'s order
      (True), or yields nothing (False; the contract allows it, the manager then cannot write
      blocks ahead of their eviction).
    - `keeps_hit_blocks`: blocks hit again outlive blocks stored once and never hit (true of
      LRU, ARC, SIEVE, prefix-freq; not of FIFO).
    """

    policy_factory: ClassVar[Callable[[int], Any] | None] = None
    predicts_victims: ClassVar[bool] = True
    keeps_hit_blocks: ClassVar[bool] = True

    def make_policy(self, capacity: int) -> CachePolicy:
        """A fresh policy of `capacity` blocks, completed with `keys`/`len`/`clear` if needed."""
        factory = type(self).policy_factory
        if factory is None:
            raise NotImplementedError(f"{type(self).__name__}: set policy_factory or override make_policy")
        return with_key_index(factory(capacity))

    def same_future(self, policy: CachePolicy, twin: CachePolicy, capacity: int, returning: list[int],
                    clause: str) -> None:
        """`policy` and `twin` (built alike, `capacity` blocks) are indistinguishable through the
        contract, now and from now on (`returning`: ids of earlier keys the probe stores again);
        `clause`: the rule broken if they are not (what `policy` saw that `twin` did not)."""
        assert observe(policy, by_identity=False) == observe(twin, by_identity=False), \
            f"{clause}: the observable state changed"
        assert probe(policy, capacity, returning) == probe(twin, capacity, returning), \
            f"{clause}: hidden state changed (later decisions differ from a twin's)"

    # ------------------------------------------------------------------ basic operations
    def test_capacity_must_be_positive(self):
        try:
            policy = self.make_policy(0)
        except ValueError:
            return
        pytest.fail(f"{contract.CAPACITY}: make_policy(0) returned {type(policy).__name__}")

    def test_insert_get_remove(self):
        policy = self.make_policy(16)
        blocks = fill(policy, range(5))
        assert len(policy) == 5, f"{contract.RESIDENT}: len() is {len(policy)} after 5 inserts"
        assert set(policy.keys()) == set(blocks), f"{contract.RESIDENT}: keys() are not the 5 inserted keys"
        for k, b in blocks.items():
            assert same_block(policy, policy.get(k), b), f"{contract.GET}: get({k!r}) is not the inserted block"
        assert policy.get(key(99)) is None, f"{contract.GET}: get() of an absent key is not None"
        call(contract.REMOVE, "remove(key(2))", policy.remove, key(2))
        assert policy.get(key(2)) is None, f"{contract.REMOVE}: get() still finds a removed key"
        assert len(policy) == 4, f"{contract.REMOVE}: len() is {len(policy)} after removing 1 of 5"
        call(contract.REMOVE_ABSENT, "remove() of a key removed before", policy.remove, key(2))
        call(contract.REMOVE_ABSENT, "remove() of a key never inserted", policy.remove, key(99))
        assert len(policy) == 4, f"{contract.REMOVE_ABSENT}: len() changed to {len(policy)}"
        assert key(2) not in set(policy.keys()), f"{contract.RESIDENT}: keys() lists a removed key"

    def test_insert_many_inserts_each(self):
        policy = self.make_policy(16)
        blocks = [ready(i) for i in range(4)]
        call(contract.INSERT_MANY, "insert_many(4 keys, 4 blocks)", policy.insert_many,
             [key(i) for i in range(4)], blocks)
        assert len(policy) == 4, f"{contract.INSERT_MANY}: len() is {len(policy)} after inserting 4"
        assert all(same_block(policy, policy.get(key(i)), blocks[i]) for i in range(4)), \
            f"{contract.INSERT_MANY}: get() does not return each inserted block"

    def test_touch_ignores_absent_keys_and_keeps_blocks(self):
        policy = self.make_policy(16)
        blocks = fill(policy, range(4))
        call(contract.TOUCH, "touch() with absent keys", policy.touch, [key(100), key(1), key(101)])
        call(contract.TOUCH, "touch([])", policy.touch, [])
        assert set(policy.keys()) == set(blocks), f"{contract.TOUCH}: the resident keys changed"
        assert all(same_block(policy, policy.get(k), b) for k, b in blocks.items()), \
            f"{contract.TOUCH}: a resident block was replaced"
        assert policy.get(key(100)) is None, f"{contract.TOUCH}: touching an absent key made it resident"

    def test_touched_prefix_outlives_untouched_blocks(self):
        if not self.keeps_hit_blocks:
            pytest.skip("declared: keeps_hit_blocks = False")
        policy = self.make_policy(8)
        fill(policy, range(8))
        policy.touch([key(0), key(1)])
        victims = policy.evict(4, set())
        assert victims is not None and len(victims) == 4, f"{contract.EVICT_EXACT}: evict(4) of 8 gave {victims!r}"
        evicted = {k for k, _ in victims}
        assert key(0) not in evicted and key(1) not in evicted, \
            f"{contract.HIT_OUTLIVES}: evict(4) took a touched block before 6 untouched ones"

    # ------------------------------------------------------------------ clear
    def test_clear(self):
        policy = self.make_policy(16)
        fill(policy, range(10))
        policy.touch([key(1)])
        policy.evict(3, set())
        call(contract.CLEAR, "clear()", policy.clear)
        assert len(policy) == 0, f"{contract.CLEAR}: len() is {len(policy)}"
        assert list(policy.keys()) == [], f"{contract.CLEAR}: keys() is not empty"
        assert all(policy.get(key(i)) is None for i in range(10)), f"{contract.CLEAR}: get() still finds a block"
        assert policy.victims(16) == [], f"{contract.CLEAR}: victims() is not empty"
        assert policy.evict(1, set()) is None, f"{contract.CLEAR}: evict(1) succeeded on an empty policy"
        blocks = fill(policy, range(3))  # usable again
        assert set(policy.keys()) == set(blocks), f"{contract.CLEAR}: inserts after clear() are not resident"
        assert all(same_block(policy, policy.get(k), b) for k, b in blocks.items()), \
            f"{contract.CLEAR}: get() after clear() and insert is not the inserted block"
