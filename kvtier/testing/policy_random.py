"""The Hypothesis half of `PolicyTests`: random operation sequences checked against a model of
the resident blocks, and `insert_many` against a loop of `insert`. Every failure message starts
with the contract clause it enforces (`kvtier.testing.policy_contract`)."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count
from typing import ClassVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus
from kvtier.policies.base import CachePolicy
from kvtier.testing import policy_contract as contract
from kvtier.testing.clauses import call
from kvtier.testing.policy_helpers import key, observe, ready, same_block, set_ref_cnt, values_of

_HEALTH = [HealthCheck.too_slow, HealthCheck.differing_executors]


class RandomOperations:
    """A mixin of `PolicyTests`, of its own only to keep each class readable; it needs what
    `PolicyTests` provides (declared here)."""

    predicts_victims: ClassVar[bool] = True

    def make_policy(self, capacity: int) -> CachePolicy:
        raise NotImplementedError  # PolicyTests.make_policy

    def same_future(self, policy: CachePolicy, twin: CachePolicy, capacity: int, returning: list[int],
                    clause: str) -> None:
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
        and evict/victims must obey the contract at every step. A twin gets every operation but
        the refused evictions and the `victims` calls, which must change nothing: the two must
        show the same state after every step (a change may show only once a block is unpinned)."""
        capacity = 12
        policy, twin = self.make_policy(capacity), self.make_policy(capacity)
        model: dict[OffloadKey, BlockStatus] = {}
        twins: dict[OffloadKey, BlockStatus] = {}  # the twin's blocks (objects of its own)
        ids = count()  # block ids, never reused
        for op in ops:
            if op[0] == "peek":
                self._check_candidates(policy, model)
            elif op[0] == "evict":  # protected: mostly resident keys (op[2] indexes them), sometimes absent ones
                resident = sorted(model)
                protected = {resident[i % len(resident)] if resident and i < 20 else key(i) for i in op[2]}
                if self._check_evict(policy, model, op[1], protected) is not None:
                    for k, _ in twin.evict(op[1], protected) or ():
                        twins.pop(k, None)
            elif not self._apply(op, (policy, model), (twin, twins), capacity, ids):
                continue
            self._check_resident(policy, model, op)
            assert observe(policy, by_identity=False) == observe(twin, by_identity=False), \
                f"{contract.EVICT_REFUSED} (and {contract.CANDIDATES_PURE}): after {op} the policy and a twin " \
                f"that saw only the calls that may change state differ"

    @staticmethod
    def _apply(op: tuple, main: tuple[CachePolicy, dict[OffloadKey, BlockStatus]],
               other: tuple[CachePolicy, dict[OffloadKey, BlockStatus]], capacity: int, ids: Iterator[int]) -> bool:
        """Apply an insert, remove, touch or pin to the policy (`main`: checked, with its model)
        and to its twin (`other`); False when the op does not apply (nothing was called)."""
        (policy, model), (twin, twins) = main, other
        kind = op[0]
        if kind == "insert":
            k = key(op[1])
            if k in model or len(model) >= capacity:
                return False  # the manager never inserts a resident key or beyond capacity
            block_id = next(ids)
            model[k], twins[k] = ready(block_id), ready(block_id)
            policy.insert(k, model[k])
            twin.insert(k, twins[k])
        elif kind == "remove":
            k = key(op[1])
            call(contract.REMOVE_ABSENT if k not in model else contract.REMOVE, f"remove(key({op[1]}))",
                 policy.remove, k)
            twin.remove(k)
            model.pop(k, None)
            twins.pop(k, None)
        elif kind == "touch":
            call(contract.TOUCH, f"touch({op[1]})", policy.touch, [key(i) for i in op[1]])
            twin.touch([key(i) for i in op[1]])
        elif model:  # pin: the op[1]-th resident block (pins must hit resident blocks)
            k = sorted(model)[op[1] % len(model)]
            set_ref_cnt(policy, k, model[k], op[2])
            set_ref_cnt(twin, k, twins[k], op[2])
        return True

    @staticmethod
    def _check_resident(policy: CachePolicy, model: dict[OffloadKey, BlockStatus], op) -> None:
        assert len(policy) == len(model), f"{contract.RESIDENT}: len() is {len(policy)}, " \
                                          f"{len(model)} blocks are resident (after {op})"
        assert set(policy.keys()) == set(model), f"{contract.RESIDENT}: keys() differ from the " \
                                                 f"resident blocks after {op}"
        for k, b in model.items():
            assert same_block(policy, policy.get(k), b), f"{contract.GET}: wrong block for {k!r} after {op}"

    def _check_candidates(self, policy: CachePolicy, model: dict[OffloadKey, BlockStatus]) -> None:
        before = observe(policy)
        candidates = policy.victims(len(policy))
        assert len(set(candidates)) == len(candidates), f"{contract.CANDIDATES}: a block listed twice"
        for n in (0, 1, 3, len(candidates) + 1):
            assert policy.victims(n) == candidates[:n], f"{contract.VICTIM_KEYS}: victims({n}) differs"
        evictable = {k for k, b in model.items() if b.ref_cnt == 0}
        if self.predicts_victims:
            assert set(candidates) == evictable, f"{contract.CANDIDATES}: listed {len(candidates)} blocks, " \
                                                 f"{len(evictable)} are evictable"
        else:
            assert set(candidates) <= evictable, f"{contract.CANDIDATES}: a pinned block was listed"
        assert observe(policy) == before, f"{contract.CANDIDATES_PURE}: the observable state changed"

    def _check_evict(self, policy: CachePolicy, model: dict[OffloadKey, BlockStatus], n: int,
                     protected: set[OffloadKey]) -> list | None:
        """`evict(n, protected)` checked against the model; what it returned."""
        evictable = [k for k, b in model.items() if b.ref_cnt == 0 and k not in protected]
        before = observe(policy)
        predicted = policy.victims(n, protected)
        victims = call(contract.EVICT_EXACT, f"evict({n}, ...)", policy.evict, n, protected)
        if n <= 0:
            assert victims == [], f"{contract.EVICT_NONPOSITIVE}: evict({n}) returned {victims!r}"
        if len(evictable) < n:
            assert victims is None, f"{contract.EVICT_REFUSED}: evict({n}) returned {len(victims or [])} " \
                                    f"blocks with only {len(evictable)} evictable"
            assert observe(policy) == before, f"{contract.EVICT_REFUSED}: a refused evict({n}) changed the state"
            return victims
        assert victims is not None and len(victims) == max(n, 0), \
            f"{contract.EVICT_EXACT}: evict({n}) returned {victims!r} with {len(evictable)} evictable"
        chosen = [k for k, _ in victims]
        assert len(set(chosen)) == len(chosen), f"{contract.EVICT_EXACT}: a block returned twice"
        assert set(chosen) <= set(evictable), f"{contract.PINNED}: evicted {set(chosen) - set(evictable)}"
        if self.predicts_victims and not protected:
            assert chosen == predicted, f"{contract.CANDIDATES_ORDER}: evicted {chosen}, predicted {predicted}"
        for k, b in victims:
            assert same_block(policy, b, model.pop(k)), f"{contract.EVICT_EXACT}: wrong block for {k!r}"
        return victims

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
                same = values_of(victims) == values_of(other) if bulk.returns_views else victims == other
                assert same, f"{contract.INSERT_MANY}: evict({op[1]}) chose {values_of(victims)} after " \
                             f"insert_many, {values_of(other)} after insert()"
                for k, _ in victims or ():
                    del resident[k]
            assert observe(bulk) == observe(loop), f"{contract.INSERT_MANY}: states differ after {op}"
        self.same_future(bulk, loop, capacity, list(range(32)), contract.INSERT_MANY)
