"""`PolicyTests`: the `CachePolicy` contract as a pytest suite a third-party policy subclasses.

    # test_my_policy.py
    from kvtier.testing.policy import PolicyTests
    from my_package import MyPolicy

    class TestMyPolicy(PolicyTests):
        policy_factory = MyPolicy          # or override make_policy(self, capacity)
        predicts_victims = False           # if victim_candidates() yields nothing

Everything is observed through the public contract only: which keys are resident and their
block objects (`keys`, `get`), `len`, the eviction order (`victim_candidates`) and what `evict`
returns. "Changes nothing" is checked twice: the observable state is the same afterwards, and a
twin policy that never saw the call makes the same decisions from then on. A policy written to
vLLM's seed contract (no `keys`/`len`/`clear`) is completed by `with_key_index` first, as
`build_hierarchy` does.

A policy whose `get` returns views of its own state (`CachePolicy.returns_views`) is checked by
value (`block_id`, `ref_cnt`) where others are checked by identity, and its blocks' `ref_cnt` is
changed through `get`, as the manager does.

Needs pytest and hypothesis; uses no fixture and no conftest of the kvtier repository.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.keys import OffloadKey, make_offload_key
from kvtier.policies.base import CachePolicy, with_key_index
from kvtier.types import BlockStatus

__all__ = ["PolicyTests"]

_HEALTH = [HealthCheck.too_slow, HealthCheck.differing_executors]


def key(i: int) -> OffloadKey:
    """The key of block number `i` (distinct `i`, distinct keys)."""
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ready(block_id: int, ref_cnt: int = 0) -> BlockStatus:
    """A stored, readable block (ref_cnt 0: evictable)."""
    block = BlockStatus(block_id)
    block.ref_cnt = ref_cnt
    return block


def fill(policy: CachePolicy, ids: Iterable[int]) -> dict[OffloadKey, BlockStatus]:
    """Insert a ready block for each id, in order; returns key -> block."""
    blocks = {}
    for i in ids:
        blocks[key(i)] = ready(i)
        policy.insert(key(i), blocks[key(i)])
    return blocks


def set_ref_cnt(policy: CachePolicy, k: OffloadKey, block: BlockStatus, value: int) -> None:
    """Set the `ref_cnt` of resident block `block` (inserted under `k`) as the manager does: on
    the object itself and, for a policy returning views, through `get` (the object is a copy)."""
    block.ref_cnt = value
    if policy.returns_views:
        held = policy.get(k)
        assert held is not None and held.block_id == block.block_id, f"get({k!r}) lost block {block.block_id}"
        held.ref_cnt = value


def same_block(policy: CachePolicy, got: Any, expected: BlockStatus) -> bool:
    """Whether `got` (from `get`, `evict`, `victim_candidates`) is the block inserted as
    `expected`: the object itself, or for a policy returning views, one with its values."""
    if not policy.returns_views:
        return got is expected
    return got is not None and (got.block_id, got.ref_cnt) == (expected.block_id, expected.ref_cnt)


def observe(policy: CachePolicy, by_identity: bool = True):
    """What the contract lets anyone see: resident key -> block (the object itself, or its slot
    number when comparing twins that hold distinct but equal blocks; a view's values), size,
    eviction order. Asking `victim_candidates` twice must give the same order (it changes nothing)."""
    views = policy.returns_views
    resident = {k: (b.block_id, b.ref_cnt) if views else id(b) if by_identity else b.block_id
                for k in policy.keys() if (b := policy.get(k)) is not None}
    order = [k for k, _ in policy.victim_candidates()]
    assert [k for k, _ in policy.victim_candidates()] == order, "victim_candidates changed the eviction order"
    return resident, len(policy), order


# The probe a policy and its twin both get: touches, fresh and returning keys, then evictions
# one at a time until nothing is left, so hidden history (ghosts, frequencies) shows in decisions.
_PROBE_IDS = (1000, 1001, 1002, 1003)


def _values(victims) -> list | None:
    return None if victims is None else [(k, b.block_id, b.ref_cnt) for k, b in victims]


def _victim_keys(victims) -> list[OffloadKey] | None:
    return None if victims is None else [k for k, _ in victims]


def _probe(policy: CachePolicy, capacity: int, returning: list[int]) -> list:
    """Decisions of `policy` under a fixed sequence (never beyond `capacity`), as comparable data."""
    trace: list = []
    policy.touch(sorted(policy.keys())[:2])
    trace.append(observe(policy, by_identity=False))
    for j, i in enumerate(list(_PROBE_IDS) + returning):
        if policy.get(key(i)) is not None:
            continue
        if len(policy) >= capacity:
            trace.append(_victim_keys(policy.evict(1, set())))
            if len(policy) >= capacity:
                continue
        policy.insert(key(i), ready(10_000 + j))
        trace.append(observe(policy, by_identity=False))
    while len(trace) < 1000:
        trace.append(_victim_keys(policy.evict(1, set())))
        if trace[-1] is None:
            break
    return trace


class _RandomOperations:
    """The Hypothesis half of `PolicyTests`: random operation sequences checked against a model of
    the resident blocks. A mixin of its own only to keep each class readable; it needs what
    `PolicyTests` provides (declared here)."""

    predicts_victims: ClassVar[bool] = True

    def make_policy(self, capacity: int) -> CachePolicy:
        raise NotImplementedError  # PolicyTests.make_policy

    def same_future(self, policy: CachePolicy, twin: CachePolicy, capacity: int, returning: list[int]) -> None:
        raise NotImplementedError  # PolicyTests.same_future

    @settings(max_examples=150, deadline=None, suppress_health_check=_HEALTH, report_multiple_bugs=False)
    @given(ops=st.lists(
        st.one_of(
            st.tuples(st.just("insert"), st.integers(0, 23)),
            st.tuples(st.just("insert"), st.integers(0, 23)),
            st.tuples(st.just("remove"), st.integers(0, 23)),
            st.tuples(st.just("touch"), st.lists(st.integers(0, 23), max_size=5)),
            st.tuples(st.just("evict"), st.integers(0, 5), st.sets(st.integers(0, 23), max_size=4)),
            st.tuples(st.just("pin"), st.integers(0, 23), st.sampled_from([-1, 0, 1, 2])),
            st.tuples(st.just("peek"), st.integers(0, 3)),
        ),
        max_size=80,
    ))
    def test_random_operations_against_model(self, ops):
        """The model is the set of resident blocks; the policy must agree with it on residence,
        and evict/victim_candidates must obey the contract at every step."""
        capacity = 12
        policy = self.make_policy(capacity)
        model: dict[OffloadKey, BlockStatus] = {}
        next_id = 0
        for op in ops:
            kind = op[0]
            if kind == "insert":
                k = key(op[1])
                if k in model or len(model) >= capacity:
                    continue  # the manager never inserts a resident key or beyond capacity
                model[k] = ready(next_id)
                next_id += 1
                policy.insert(k, model[k])
            elif kind == "remove":
                policy.remove(key(op[1]))
                model.pop(key(op[1]), None)
            elif kind == "touch":
                policy.touch([key(i) for i in op[1]])
            elif kind == "pin":  # the op[1]-th resident block (pins must hit resident blocks)
                if model:
                    k = sorted(model)[op[1] % len(model)]
                    set_ref_cnt(policy, k, model[k], op[2])
            elif kind == "peek":
                self._check_candidates(policy, model)
            else:  # protected: mostly resident keys (op[2] indexes them), sometimes absent ones
                resident = sorted(model)
                protected = {resident[i % len(resident)] if resident and i < 20 else key(i) for i in op[2]}
                self._check_evict(policy, model, op[1], protected)
            assert len(policy) == len(model)
            assert set(policy.keys()) == set(model)
            for k, b in model.items():
                assert same_block(policy, policy.get(k), b)

    def _check_candidates(self, policy: CachePolicy, model: dict[OffloadKey, BlockStatus]) -> None:
        before = observe(policy)
        candidates = [k for k, _ in policy.victim_candidates()]
        assert len(set(candidates)) == len(candidates), "a block listed twice"
        for n in (0, 1, 3, len(candidates) + 1):
            assert policy.victim_keys(n) == candidates[:n], f"victim_keys({n}) is not the head of victim_candidates"
        evictable = {k for k, b in model.items() if b.ref_cnt == 0}
        if self.predicts_victims:
            assert set(candidates) == evictable
        else:
            assert set(candidates) <= evictable
        assert observe(policy) == before

    def _check_evict(self, policy: CachePolicy, model: dict[OffloadKey, BlockStatus], n: int,
                     protected: set[OffloadKey]) -> None:
        evictable = [k for k, b in model.items() if b.ref_cnt == 0 and k not in protected]
        before = observe(policy)
        predicted = [k for k, _ in policy.victim_candidates() if k not in protected][:n]
        victims = policy.evict(n, protected)
        if len(evictable) < n:
            assert victims is None, f"evicted {victims} with only {len(evictable)} evictable"
            assert observe(policy) == before
            return
        assert victims is not None and len(victims) == max(n, 0)
        chosen = [k for k, _ in victims]
        assert len(set(chosen)) == len(chosen)
        assert set(chosen) <= set(evictable), "evicted a pinned, unready or protected block"
        if self.predicts_victims and not protected:
            assert chosen == predicted
        for k, b in victims:
            assert same_block(policy, b, model.pop(k))

    @settings(max_examples=120, deadline=None, suppress_health_check=_HEALTH, report_multiple_bugs=False)
    @given(ops=st.lists(
        st.one_of(
            st.tuples(st.just("insert"), st.lists(st.integers(0, 31), max_size=6, unique=True)),
            st.tuples(st.just("touch"), st.lists(st.integers(0, 31), max_size=5)),
            st.tuples(st.just("evict"), st.integers(1, 6), st.sets(st.integers(0, 31), max_size=3)),
            st.tuples(st.just("remove"), st.integers(0, 31)),
        ),
        max_size=60,
    ))
    def test_insert_many_equals_insert_loop(self, ops):
        """`insert_many` (the manager's store path) and a loop of `insert` are indistinguishable:
        the same observable state after every step and the same decisions afterwards, so history
        such as ghost lists must match too."""
        capacity = 16
        bulk, loop = self.make_policy(capacity), self.make_policy(capacity)
        resident: dict[OffloadKey, BlockStatus] = {}
        next_id = 0
        for op in ops:
            if op[0] == "insert":
                keys = [key(i) for i in op[1] if key(i) not in resident][:capacity - len(resident)]
                blocks = [ready(next_id + j) for j in range(len(keys))]
                next_id += len(keys)
                resident.update(zip(keys, blocks))
                bulk.insert_many(keys, blocks)
                for k, b in zip(keys, blocks):
                    loop.insert(k, b)
            elif op[0] == "touch":
                for policy in (bulk, loop):
                    policy.touch([key(i) for i in op[1]])
            elif op[0] == "remove":
                resident.pop(key(op[1]), None)
                for policy in (bulk, loop):
                    policy.remove(key(op[1]))
            else:
                protected = {key(i) for i in op[2]}
                victims = bulk.evict(op[1], protected)
                other = loop.evict(op[1], protected)
                if bulk.returns_views:  # distinct copies: compared by value
                    assert _values(victims) == _values(other)
                else:
                    assert victims == other
                for k, _ in victims or ():
                    del resident[k]
            assert observe(bulk) == observe(loop)
        self.same_future(bulk, loop, capacity, returning=list(range(32)))


class PolicyTests(_RandomOperations):
    """Subclass as `class TestMine(PolicyTests)` and set `policy_factory` (a callable taking the
    capacity in blocks) or override `make_policy`.

    Declarations a policy may change:
    - `predicts_victims`: `victim_candidates()` lists the evictable blocks in `evict`'s order
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

    def same_future(self, policy: CachePolicy, twin: CachePolicy, capacity: int, returning: list[int]) -> None:
        """`policy` and `twin` (built alike, `capacity` blocks) are indistinguishable through the
        contract, now and from now on (`returning`: ids of earlier keys the probe stores again)."""
        assert observe(policy, by_identity=False) == observe(twin, by_identity=False)
        assert _probe(policy, capacity, returning) == _probe(twin, capacity, returning), \
            "hidden state differs: later decisions differ"

    # ------------------------------------------------------------------ basic operations
    def test_capacity_must_be_positive(self):
        with pytest.raises(ValueError):
            self.make_policy(0)

    def test_insert_get_remove(self):
        policy = self.make_policy(16)
        blocks = fill(policy, range(5))
        assert len(policy) == 5
        assert set(policy.keys()) == set(blocks)
        for k, b in blocks.items():
            assert same_block(policy, policy.get(k), b)
        assert policy.get(key(99)) is None
        policy.remove(key(2))
        assert policy.get(key(2)) is None
        assert len(policy) == 4
        policy.remove(key(2))  # removing an absent key is a no-op
        policy.remove(key(99))
        assert len(policy) == 4
        assert key(2) not in set(policy.keys())

    def test_insert_many_inserts_each(self):
        policy = self.make_policy(16)
        blocks = [ready(i) for i in range(4)]
        policy.insert_many([key(i) for i in range(4)], blocks)
        assert len(policy) == 4
        assert all(same_block(policy, policy.get(key(i)), blocks[i]) for i in range(4))

    def test_touch_ignores_absent_keys_and_keeps_blocks(self):
        policy = self.make_policy(16)
        blocks = fill(policy, range(4))
        policy.touch([key(100), key(1), key(101)])
        policy.touch([])
        assert set(policy.keys()) == set(blocks)
        assert all(same_block(policy, policy.get(k), b) for k, b in blocks.items())
        assert policy.get(key(100)) is None

    def test_touched_prefix_outlives_untouched_blocks(self):
        if not self.keeps_hit_blocks:
            pytest.skip("declared: keeps_hit_blocks = False")
        policy = self.make_policy(8)
        fill(policy, range(8))
        policy.touch([key(0), key(1)])
        victims = policy.evict(4, set())
        assert victims is not None and len(victims) == 4
        evicted = {k for k, _ in victims}
        assert key(0) not in evicted and key(1) not in evicted

    # ------------------------------------------------------------------ evict
    def test_evict_zero_and_negative(self):
        policy, twin = self.make_policy(16), self.make_policy(16)
        for p in (policy, twin):
            fill(p, range(3))
        assert policy.evict(0, set()) == []
        assert policy.evict(-1, set()) == []
        self.same_future(policy, twin, 16, returning=[0, 1])

    def test_evict_exactly_n(self):
        policy = self.make_policy(16)
        blocks = fill(policy, range(10))
        victims = policy.evict(3, set())
        assert victims is not None and len(victims) == 3
        assert len({k for k, _ in victims}) == 3
        for k, b in victims:
            assert same_block(policy, b, blocks[k])
            assert policy.get(k) is None
        assert len(policy) == 7
        assert set(policy.keys()) == set(blocks) - {k for k, _ in victims}

    def test_evict_too_many_returns_none_without_change(self):
        policy, twin = self.make_policy(16), self.make_policy(16)
        for p in (policy, twin):
            fill(p, range(6))
            p.touch([key(1), key(2)])
        assert policy.evict(7, set()) is None
        self.same_future(policy, twin, 16, returning=[])

    def test_pinned_and_protected_never_evicted(self):
        policy, twin = self.make_policy(16), self.make_policy(16)
        for p in (policy, twin):
            blocks = fill(p, range(8))
            set_ref_cnt(p, key(0), blocks[key(0)], 1)  # being read
            set_ref_cnt(p, key(3), blocks[key(3)], -1)  # being written
        protected = {key(1), key(5)}
        assert policy.evict(5, protected) is None  # only 4 evictable
        assert observe(policy, by_identity=False) == observe(twin, by_identity=False)
        victims = policy.evict(4, protected)
        assert victims is not None
        assert {k for k, _ in victims} == {key(2), key(4), key(6), key(7)}
        assert all(policy.get(k) is not None for k in (key(0), key(1), key(3), key(5)))
        assert policy.evict(3, set()) is None  # unprotected, keys 1 and 5 are the only evictable ones...
        assert {k for k, _ in policy.evict(2, set())} == {key(1), key(5)}
        assert policy.evict(1, set()) is None  # ...and then only pinned blocks are left
        assert {policy.get(key(0)).block_id, policy.get(key(3)).block_id} == {0, 3}

    def test_pinned_blocks_become_evictable_when_unpinned(self):
        policy = self.make_policy(8)
        blocks = fill(policy, range(3))
        for k, b in blocks.items():
            set_ref_cnt(policy, k, b, 2)
        assert policy.evict(1, set()) is None
        set_ref_cnt(policy, key(1), blocks[key(1)], 0)
        victims = policy.evict(1, set())
        assert victims is not None and [k for k, _ in victims] == [key(1)]
        assert same_block(policy, victims[0][1], blocks[key(1)])

    def test_ref_cnt_set_through_get_is_seen_by_later_gets(self):
        """The manager pins and releases blocks by setting `ref_cnt` on what `get` returns (never
        on the objects it inserted, which a policy returning views copied): every later `get`
        and every decision must see the change."""
        policy = self.make_policy(8)
        blocks = fill(policy, range(3))
        held = policy.get(key(1))
        assert held is not None and held.block_id == 1 and held.is_ready
        held.ref_cnt = 2
        again = policy.get(key(1))
        assert again is not None and again.ref_cnt == 2 and again.block_id == 1
        assert key(1) not in {k for k, _ in policy.victim_candidates()}
        victims = policy.evict(2, set())
        assert victims is not None and {k for k, _ in victims} == {key(0), key(2)}
        assert policy.evict(1, set()) is None  # only the pinned block is left
        policy.get(key(1)).ref_cnt = -1  # being written: not ready
        assert policy.get(key(1)).is_ready is False
        policy.get(key(1)).ref_cnt = 0
        assert [k for k, _ in policy.victim_candidates()] == ([key(1)] if self.predicts_victims else [])
        victims = policy.evict(1, set())
        assert victims is not None and victims[0][0] == key(1) and victims[0][1].block_id == 1
        if not policy.returns_views:
            assert victims[0][1] is blocks[key(1)]

    # ------------------------------------------------------------------ victim_candidates
    def test_victim_candidates_only_evictable_blocks(self):
        policy = self.make_policy(16)
        blocks = fill(policy, range(6))
        set_ref_cnt(policy, key(2), blocks[key(2)], 2)
        set_ref_cnt(policy, key(4), blocks[key(4)], -1)
        candidates = [k for k, _ in policy.victim_candidates()]
        assert len(set(candidates)) == len(candidates)
        if self.predicts_victims:
            assert set(candidates) == {key(i) for i in (0, 1, 3, 5)}
        else:
            assert set(candidates) <= {key(i) for i in (0, 1, 3, 5)}

    def test_victim_candidates_changes_nothing(self):
        policy, twin = self.make_policy(8), self.make_policy(8)
        for p in (policy, twin):
            fill(p, range(6))
            p.touch([key(3)])
        for _ in range(3):
            list(policy.victim_candidates())
        next(iter(policy.victim_candidates()), None)  # a partly consumed iterator too
        self.same_future(policy, twin, 8, returning=[3])

    @pytest.mark.parametrize("n", [1, 3, 6])
    def test_victim_candidates_is_the_evict_order(self, n):
        if not self.predicts_victims:
            pytest.skip("declared: predicts_victims = False")
        policy = self.make_policy(8)
        fill(policy, range(8))
        policy.touch([key(4), key(5)])
        policy.touch([key(1)])
        predicted = [k for k, _ in policy.victim_candidates()][:n]
        assert len(predicted) == n
        victims = policy.evict(n, set())
        assert [k for k, _ in victims] == predicted

    def test_victim_candidates_is_the_evict_order_one_at_a_time(self):
        if not self.predicts_victims:
            pytest.skip("declared: predicts_victims = False")
        policy = self.make_policy(8)
        fill(policy, range(8))
        policy.touch([key(6), key(7), key(0)])
        predicted = [k for k, _ in policy.victim_candidates()]
        got = []
        while (victims := policy.evict(1, set())) is not None:
            got.append(victims[0][0])
        assert got == predicted
        assert len(policy) == 0

    # ------------------------------------------------------------------ clear
    def test_clear(self):
        policy = self.make_policy(16)
        fill(policy, range(10))
        policy.touch([key(1)])
        policy.evict(3, set())
        policy.clear()
        assert len(policy) == 0
        assert list(policy.keys()) == []
        assert all(policy.get(key(i)) is None for i in range(10))
        assert list(policy.victim_candidates()) == []
        assert policy.evict(1, set()) is None
        blocks = fill(policy, range(3))  # usable again
        assert set(policy.keys()) == set(blocks)
        assert all(same_block(policy, policy.get(k), b) for k, b in blocks.items())
