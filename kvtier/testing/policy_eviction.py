"""The eviction half of `PolicyTests`: `evict` and `victims` (see
`kvtier.testing.policy` for how the suite observes a policy)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvtier.testing import policy_contract as contract
from kvtier.testing.clauses import call
from kvtier.testing.policy_helpers import (
    fill,
    key,
    observe,
    same_block,
    set_ref_cnt,
    victim_keys_of,
)
from kvtier.testing.policy_random import RandomOperations


class EvictionTests(RandomOperations):
    """`evict(n, protected)` and `victims(n, skip)`; `predicts_victims` and `keeps_hit_blocks` are
    declared by the subclass (see `PolicyTests`)."""

    predicts_victims: ClassVar[bool] = True
    keeps_hit_blocks: ClassVar[bool] = True

    # ------------------------------------------------------------------ evict
    def test_evict_zero_and_negative(self):
        policy, twin = self.make_policy(16), self.make_policy(16)
        for p in (policy, twin):
            fill(p, range(3))
        for n in (0, -1):
            got = call(contract.EVICT_NONPOSITIVE, f"evict({n})", policy.evict, n, set())
            assert got == [], f"{contract.EVICT_NONPOSITIVE}: evict({n}) returned {got!r}"
        self.same_future(policy, twin, 16, [0, 1], contract.EVICT_NONPOSITIVE)

    def test_evict_exactly_n(self):
        policy = self.make_policy(16)
        blocks = fill(policy, range(10))
        victims = policy.evict(3, set())
        assert victims is not None and len(victims) == 3, f"{contract.EVICT_EXACT}: evict(3) of 10 gave {victims!r}"
        assert len({k for k, _ in victims}) == 3, f"{contract.EVICT_EXACT}: a block returned twice"
        for k, b in victims:
            assert same_block(policy, b, blocks[k]), f"{contract.EVICT_EXACT}: not the block inserted under {k!r}"
            assert policy.get(k) is None, f"{contract.EVICT_EXACT}: an evicted key is still resident"
        assert len(policy) == 7, f"{contract.EVICT_EXACT}: len() is {len(policy)} after evicting 3 of 10"
        assert set(policy.keys()) == set(blocks) - {k for k, _ in victims}, \
            f"{contract.EVICT_EXACT}: keys() differ from the 7 blocks left"

    def test_evict_too_many_returns_none_without_change(self):
        policy, twin = self.make_policy(16), self.make_policy(16)
        for p in (policy, twin):
            fill(p, range(6))
            p.touch([key(1), key(2)])
        got = policy.evict(7, set())
        assert got is None, f"{contract.EVICT_REFUSED}: evict(7) with 6 blocks returned {got!r}"
        self.same_future(policy, twin, 16, [], contract.EVICT_REFUSED)

    def test_pinned_and_protected_never_evicted(self):
        policy, twin = self.make_policy(16), self.make_policy(16)
        for p in (policy, twin):
            blocks = fill(p, range(8))
            set_ref_cnt(p, key(0), blocks[key(0)], 1)  # being read
            set_ref_cnt(p, key(3), blocks[key(3)], -1)  # being written
        protected = {key(1), key(5)}
        got = policy.evict(5, protected)
        assert got is None, f"{contract.EVICT_REFUSED}: evict(5) with 4 evictable (2 pinned, 2 protected) " \
                            f"returned {[k for k, _ in got]}"
        assert observe(policy, by_identity=False) == observe(twin, by_identity=False), \
            f"{contract.EVICT_REFUSED}: the refused evict(5) changed the state"
        victims = policy.evict(4, protected)
        assert victims is not None, f"{contract.EVICT_EXACT}: evict(4) with 4 evictable returned None"
        assert {k for k, _ in victims} == {key(2), key(4), key(6), key(7)}, \
            f"{contract.PINNED}: evict(4) took {sorted(k for k, _ in victims)}"
        assert all(policy.get(k) is not None for k in (key(0), key(1), key(3), key(5))), \
            f"{contract.PINNED}: a pinned or protected block is gone"
        assert policy.evict(3, set()) is None, f"{contract.PINNED}: evict(3) succeeded with 2 unpinned blocks"
        left = policy.evict(2, set())
        assert left is not None and {k for k, _ in left} == {key(1), key(5)}, \
            f"{contract.PINNED}: evict(2) should take the two unprotected blocks, took {left!r}"
        assert policy.evict(1, set()) is None, f"{contract.PINNED}: evict(1) succeeded with only pinned blocks"
        assert {policy.get(key(0)).block_id, policy.get(key(3)).block_id} == {0, 3}, \
            f"{contract.PINNED}: a pinned block was replaced"

    def test_pinned_blocks_become_evictable_when_unpinned(self):
        policy = self.make_policy(8)
        blocks = fill(policy, range(3))
        for k, b in blocks.items():
            set_ref_cnt(policy, k, b, 2)
        assert policy.evict(1, set()) is None, f"{contract.PINNED}: evict(1) succeeded with every block pinned"
        set_ref_cnt(policy, key(1), blocks[key(1)], 0)
        victims = policy.evict(1, set())
        assert victims is not None and [k for k, _ in victims] == [key(1)], \
            f"{contract.UNPINNED}: evict(1) gave {victims!r}, not the one unpinned block"
        assert same_block(policy, victims[0][1], blocks[key(1)]), f"{contract.EVICT_EXACT}: not the inserted block"

    def test_ref_cnt_set_through_get_is_seen_by_later_gets(self):
        """The manager pins and releases blocks by setting `ref_cnt` on what `get` returns (never
        on the objects it inserted, which a policy returning views copied): every later `get`
        and every decision must see the change."""
        clause = contract.REF_CNT_VIA_GET
        policy = self.make_policy(8)
        blocks = fill(policy, range(3))
        held = policy.get(key(1))
        assert held is not None and held.block_id == 1 and held.is_ready, f"{contract.GET}: get(key(1)) is {held!r}"
        held.ref_cnt = 2
        again = policy.get(key(1))
        assert again is not None and again.ref_cnt == 2 and again.block_id == 1, f"{clause}: ref_cnt 2 not seen"
        assert key(1) not in policy.victims(8), f"{clause}: the pinned block is named a victim"
        victims = policy.evict(2, set())
        assert victims is not None and {k for k, _ in victims} == {key(0), key(2)}, \
            f"{clause}: evict(2) gave {victims!r}, not the two unpinned blocks"
        assert policy.evict(1, set()) is None, f"{clause}: evict(1) took the block pinned through get()"
        policy.get(key(1)).ref_cnt = -1  # being written: not ready
        assert policy.get(key(1)).is_ready is False, f"{clause}: ref_cnt -1 (being written) not seen"
        policy.get(key(1)).ref_cnt = 0
        expected = [key(1)] if self.predicts_victims else []
        assert policy.victims(8) == expected, f"{clause}: ref_cnt 0 not seen by victims()"
        victims = policy.evict(1, set())
        assert victims is not None and victims[0][0] == key(1) and victims[0][1].block_id == 1, \
            f"{clause}: evict(1) gave {victims!r} after ref_cnt 0"
        if not policy.returns_views:
            assert victims[0][1] is blocks[key(1)], f"{contract.EVICT_EXACT}: not the inserted block object"

    # ------------------------------------------------------------------ victims
    def test_victims_only_evictable_blocks(self):
        policy = self.make_policy(16)
        blocks = fill(policy, range(6))
        set_ref_cnt(policy, key(2), blocks[key(2)], 2)
        set_ref_cnt(policy, key(4), blocks[key(4)], -1)
        candidates = policy.victims(16)
        assert len(set(candidates)) == len(candidates), f"{contract.CANDIDATES}: a block listed twice"
        evictable = {key(i) for i in (0, 1, 3, 5)}
        if self.predicts_victims:
            assert set(candidates) == evictable, f"{contract.CANDIDATES}: listed {len(candidates)} of 4 evictable"
        else:
            assert set(candidates) <= evictable, f"{contract.CANDIDATES}: a pinned block was listed"

    def test_victims_changes_nothing(self):
        policy, twin = self.make_policy(8), self.make_policy(8)
        for p in (policy, twin):
            fill(p, range(6))
            p.touch([key(3)])
        for n in (8, 1, 3):
            policy.victims(n)
        policy.victims(2, {key(0)})
        self.same_future(policy, twin, 8, [3], contract.CANDIDATES_PURE)

    @pytest.mark.parametrize("n", [1, 3, 6])
    def test_victims_is_the_evict_order(self, n):
        if not self.predicts_victims:
            pytest.skip("declared: predicts_victims = False")
        policy = self.make_policy(8)
        fill(policy, range(8))
        policy.touch([key(4), key(5)])
        policy.touch([key(1)])
        predicted = policy.victims(n)
        assert len(predicted) == n, f"{contract.CANDIDATES}: {len(predicted)} victims named among 8 evictable"
        victims = policy.evict(n, set())
        assert victims is not None and [k for k, _ in victims] == predicted, \
            f"{contract.CANDIDATES_ORDER}: evict({n}) gave {victim_keys_of(victims)}, predicted {predicted}"

    def test_victims_is_the_evict_order_one_at_a_time(self):
        if not self.predicts_victims:
            pytest.skip("declared: predicts_victims = False")
        policy = self.make_policy(8)
        fill(policy, range(8))
        policy.touch([key(6), key(7), key(0)])
        predicted = policy.victims(8)
        got = []
        for _ in range(len(policy) + 1):  # bounded: a policy whose evict never refuses must fail, not hang
            if (victims := policy.evict(1, set())) is None:
                break
            got.append(victims[0][0])
        else:
            pytest.fail(f"{contract.EVICT_REFUSED}: evict(1) still gave blocks after {len(got)} calls on 8 "
                        f"evictable blocks, predicted {predicted}")
        assert got == predicted, f"{contract.CANDIDATES_ORDER}: evict(1) repeatedly gave {got}, predicted {predicted}"
        assert len(policy) == 0, f"{contract.EVICT_EXACT}: evict(1) refused with {len(policy)} evictable blocks"
