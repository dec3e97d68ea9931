"""The `CachePolicy` contract, run by every policy registered in `kvtier.registry.POLICIES`.

State is compared through the public interface only: which keys are resident (and their block
objects), `len`, and the eviction order (`victim_candidates`). A policy that evicts nothing or
refuses an eviction must leave all three unchanged.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import make_offload_key, registry
from kvtier.policies.base import CachePolicy
from kvtier.types import BlockStatus

POLICY_NAMES = sorted(registry.POLICIES)


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def make(name: str, capacity: int = 16) -> CachePolicy:
    return registry.resolve(registry.POLICIES, name)(capacity)


def ready(block_id: int, ref_cnt: int = 0) -> BlockStatus:
    block = BlockStatus(block_id)
    block.ref_cnt = ref_cnt
    return block


def fill(policy: CachePolicy, ids) -> dict[bytes, BlockStatus]:
    blocks = {}
    for i in ids:
        blocks[key(i)] = ready(i)
        policy.insert(key(i), blocks[key(i)])
    return blocks


def _freeze(value):
    """A comparable image of a policy attribute (dict order kept; blocks by identity and ref_cnt)."""
    if isinstance(value, BlockStatus):
        return ("block", id(value), value.ref_cnt)
    if isinstance(value, dict):
        return ("dict", [(_freeze(k), _freeze(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return ("seq", [_freeze(v) for v in value])
    if isinstance(value, (set, frozenset)):
        return ("set", sorted(map(repr, value)))
    if callable(value):
        return ("callable",)
    return value


def internal(policy: CachePolicy):
    """Every attribute of the policy, frozen: 'no state change' means this is unchanged."""
    return {name: _freeze(v) for name, v in sorted(vars(policy).items())}


def snapshot(policy: CachePolicy):
    """Observable state (resident keys with their block objects, size, eviction order) plus the
    full internal state."""
    frozen = internal(policy)
    resident = {k: id(policy.get(k)) for k in policy.keys()}
    order = [k for k, _ in policy.victim_candidates()]
    assert internal(policy) == frozen, "victim_candidates changed the policy's state"
    return resident, len(policy), order, frozen


@pytest.fixture(params=POLICY_NAMES)
def name(request) -> str:
    return request.param


def test_capacity_must_be_positive(name):
    with pytest.raises(ValueError):
        make(name, 0)


def test_insert_get_remove(name):
    policy = make(name)
    blocks = fill(policy, range(5))
    assert len(policy) == 5
    assert set(policy.keys()) == set(blocks)
    for k, b in blocks.items():
        assert policy.get(k) is b
    assert policy.get(key(99)) is None
    policy.remove(key(2))
    assert policy.get(key(2)) is None
    assert len(policy) == 4
    policy.remove(key(2))  # removing an absent key is a no-op
    policy.remove(key(99))
    assert len(policy) == 4
    assert key(2) not in set(policy.keys())


def test_touch_ignores_absent_keys_and_keeps_blocks(name):
    policy = make(name)
    blocks = fill(policy, range(4))
    policy.touch([key(100), key(1), key(101)])
    policy.touch([])
    assert {k: policy.get(k) for k in policy.keys()} == blocks


def test_touched_prefix_outlives_untouched_blocks(name):
    """Blocks hit again outlive blocks stored once and never hit (every policy here agrees)."""
    policy = make(name, 8)
    fill(policy, range(8))
    policy.touch([key(0), key(1)])
    victims = policy.evict(4, set())
    assert victims is not None and len(victims) == 4
    evicted = {k for k, _ in victims}
    assert key(0) not in evicted and key(1) not in evicted


def test_evict_zero_and_negative(name):
    policy = make(name)
    fill(policy, range(3))
    before = snapshot(policy)
    assert policy.evict(0, set()) == []
    assert policy.evict(-1, set()) == []
    assert snapshot(policy) == before


def test_evict_exactly_n(name):
    policy = make(name)
    blocks = fill(policy, range(10))
    victims = policy.evict(3, set())
    assert victims is not None and len(victims) == 3
    assert len({k for k, _ in victims}) == 3
    for k, b in victims:
        assert blocks[k] is b
        assert policy.get(k) is None
    assert len(policy) == 7


def test_evict_too_many_returns_none_without_change(name):
    policy = make(name)
    fill(policy, range(6))
    policy.touch([key(1), key(2)])
    before = snapshot(policy)
    assert policy.evict(7, set()) is None
    assert snapshot(policy) == before


def test_pinned_and_protected_never_evicted(name):
    policy = make(name)
    blocks = fill(policy, range(8))
    blocks[key(0)].ref_cnt = 1  # being read
    blocks[key(3)].ref_cnt = -1  # being written
    protected = {key(1), key(5)}
    before = snapshot(policy)
    assert policy.evict(5, protected) is None  # only 4 evictable
    assert snapshot(policy) == before
    victims = policy.evict(4, protected)
    assert victims is not None
    assert {k for k, _ in victims} == {key(2), key(4), key(6), key(7)}
    assert all(policy.get(k) is not None for k in (key(0), key(1), key(3), key(5)))


def test_victim_candidates_skip_pinned(name):
    policy = make(name)
    blocks = fill(policy, range(6))
    blocks[key(2)].ref_cnt = 2
    assert key(2) not in {k for k, _ in policy.victim_candidates()}


@pytest.mark.parametrize("n", [1, 3, 6])
def test_victim_candidates_is_the_evict_order(name, n):
    policy = make(name, 8)
    fill(policy, range(8))
    policy.touch([key(4), key(5)])
    policy.touch([key(1)])
    predicted = [k for k, _ in policy.victim_candidates()][:n]
    assert snapshot(policy)[2][:n] == predicted  # asking again gives the same order
    victims = policy.evict(n, set())
    assert [k for k, _ in victims] == predicted


def test_victim_candidates_is_the_evict_order_one_at_a_time(name):
    policy = make(name, 8)
    fill(policy, range(8))
    policy.touch([key(6), key(7), key(0)])
    predicted = [k for k, _ in policy.victim_candidates()]
    got = []
    while True:
        victims = policy.evict(1, set())
        if victims is None:
            break
        got.append(victims[0][0])
    assert got == predicted
    assert len(policy) == 0


def test_clear(name):
    policy = make(name)
    fill(policy, range(10))
    policy.touch([key(1)])
    policy.evict(3, set())
    policy.clear()
    assert len(policy) == 0
    assert list(policy.keys()) == []
    assert list(policy.victim_candidates()) == []
    assert policy.evict(1, set()) is None
    blocks = fill(policy, range(3))  # usable again
    assert {k: policy.get(k) for k in policy.keys()} == blocks


# ---------------------------------------------------------------- random operations against a model
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 23)),
        st.tuples(st.just("remove"), st.integers(0, 23)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 23), max_size=5)),
        st.tuples(st.just("evict"), st.integers(0, 5), st.sets(st.integers(0, 23), max_size=4)),
        st.tuples(st.just("pin"), st.integers(0, 23), st.sampled_from([-1, 0, 1])),
        st.tuples(st.just("peek"), st.integers(0, 3)),
    ),
    max_size=80,
)


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_random_operations_against_model(policy_name, ops):
    """The model is the set of resident blocks; any policy must agree with it on residence, and
    evict/victim_candidates must obey the contract at every step."""
    capacity = 12
    policy = make(policy_name, capacity)
    model: dict[bytes, BlockStatus] = {}
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
            k = key(op[1])
            policy.remove(k)
            model.pop(k, None)
        elif kind == "touch":
            policy.touch([key(i) for i in op[1]])
        elif kind == "pin":
            k = key(op[1])
            if k in model:
                model[k].ref_cnt = op[2]
        elif kind == "peek":
            # victim_candidates: evictable blocks only, each once, no state change
            before = snapshot(policy)
            cands = list(policy.victim_candidates())
            assert len({k for k, _ in cands}) == len(cands)
            assert {k for k, _ in cands} == {k for k, b in model.items() if b.ref_cnt == 0}
            assert snapshot(policy) == before
        else:
            n, protected = op[1], {key(i) for i in op[2]}
            evictable = [k for k, b in model.items() if b.ref_cnt == 0 and k not in protected]
            before = snapshot(policy)
            predicted = [k for k, _ in policy.victim_candidates() if k not in protected][:n]
            victims = policy.evict(n, protected)
            if len(evictable) < n:
                assert victims is None
                assert snapshot(policy) == before
                continue
            assert victims is not None and len(victims) == n
            chosen = [k for k, _ in victims]
            assert len(set(chosen)) == n
            assert set(chosen) <= set(evictable)
            if not protected:
                assert chosen == predicted
            for k, b in victims:
                assert model.pop(k) is b
        assert len(policy) == len(model)
        assert set(policy.keys()) == set(model)
        for k, b in model.items():
            assert policy.get(k) is b


BATCH_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 31), max_size=6, unique=True)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 31), max_size=5)),
        st.tuples(st.just("evict"), st.integers(1, 6), st.sets(st.integers(0, 31), max_size=3)),
        st.tuples(st.just("remove"), st.integers(0, 31)),
    ),
    max_size=60,
)


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=BATCH_OPS)
def test_insert_many_equals_insert_loop(policy_name, ops):
    """`insert_many` (the manager's store path) leaves exactly the state a loop of `insert` leaves,
    including history such as ghost lists, so every later decision is the same."""
    capacity = 16
    bulk, loop = make(policy_name, capacity), make(policy_name, capacity)
    resident: dict[bytes, BlockStatus] = {}
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
            assert victims == loop.evict(op[1], protected)
            for k, _ in victims or ():
                del resident[k]
        assert internal(bulk) == internal(loop)
