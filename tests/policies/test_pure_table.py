"""The pure-Python block table (`kvtier.index.PureTable`) is the only holder of a block: kvtier's
pure policies are a table composed with an order (`kvtier.index.Order`) that is never given a
`BlockStatus` and never holds one, nor its table."""

from __future__ import annotations

import gc
import random
from types import FunctionType, ModuleType

import pytest

from kvtier.core.types import BlockStatus
from kvtier.index import PolicyTable, PureTable, table_of
from kvtier.policies import ARCCachePolicy, PureLRUCachePolicy, PurePrefixFreqCachePolicy, SIEVECachePolicy
from kvtier.testing.policy import key

PURE = [PureLRUCachePolicy, PurePrefixFreqCachePolicy, ARCCachePolicy, SIEVECachePolicy]


def holds(root: object, kinds: tuple[type, ...]) -> list[object]:
    """The objects of `kinds` reachable from `root` (not through classes, modules or functions)."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, ModuleType, FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds) and obj is not root:
            found.append(obj)
        stack.extend(gc.get_referents(obj))
    return found


def carries(value: object) -> bool:
    """Whether `value` is, or contains, a `BlockStatus`."""
    if isinstance(value, BlockStatus):
        return True
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        items = list(value.items()) if isinstance(value, dict) else list(value)
        return any(map(carries, items))
    return False


class Watched:
    """An order whose every call is checked for `BlockStatus` arguments and results."""

    def __init__(self, order: object) -> None:
        self.order = order

    def __getattr__(self, name: str):
        method = getattr(self.order, name)

        def call(*args, **kwargs):
            assert not carries(args) and not carries(kwargs), f"{name} was given a block"
            out = method(*args, **kwargs)
            assert not carries(out), f"{name} returned a block"
            return out
        return call


def drive(policy, seed: int) -> None:
    """Requests through the block table and vLLM's calls alike: stores, loads, pins, touches,
    evictions, removals."""
    rng = random.Random(seed)
    table = table_of(policy)
    assert type(table) is PureTable and table is policy.table
    next_id = 0
    for _ in range(600):
        resident = sorted(table.keys())
        op = rng.random()
        if op < 0.35 or not resident:
            keys = table.absent([key(rng.randrange(next_id + 8)) for _ in range(rng.randint(1, 5))])
            keys = list(dict.fromkeys(keys))
            need = len(table) + len(keys) - policy.cache_capacity
            if need > 0 and table.evict_ids(need, set()) is None:
                continue
            table.insert_written(keys, list(range(next_id, next_id + len(keys))), tail=keys[0] if keys else None)
            next_id += len(keys)
            if rng.random() < 0.8:
                table.mark_written(keys)
        elif op < 0.5:
            loads = rng.sample(resident, min(3, len(resident)))
            if table.pin_loads(loads) is not None:
                table.touch(loads)
                table.release_loads(loads)
        elif op < 0.65:
            policy.touch(rng.sample(resident, min(4, len(resident))))
        elif op < 0.8:
            table.victims(rng.randint(1, 6), set(resident[:2]))
            got = policy.evict(rng.randint(1, 3), set(resident[:1]))
            assert got is None or all(type(b) is BlockStatus for _, b in got)
        elif op < 0.9:
            policy.remove(rng.choice(resident))
        else:
            block = BlockStatus(next_id)
            block.ref_cnt = 0
            policy.insert(key(10_000 + next_id), block)
            next_id += 1


@pytest.mark.parametrize("cls", PURE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("seed", range(3))
def test_a_pure_order_is_given_and_holds_no_block(cls, seed):
    policy = cls(24)
    order = policy.order
    policy.table.order = Watched(order)
    drive(policy, seed)
    assert len(policy) and policy.table.blocks  # (the table holds them)
    assert holds(order, (BlockStatus, PureTable, PolicyTable, cls)) == []


@pytest.mark.parametrize("cls", PURE, ids=lambda c: c.__name__)
def test_the_table_and_the_policy_see_the_same_blocks(cls):
    """`get` of the policy is the table's: the objects given to `insert`, and the ones
    `insert_written` made; the order names the keys only."""
    policy = cls(8)
    table = table_of(policy)
    block = BlockStatus(7)
    block.ref_cnt = 0
    policy.insert(key(1), block)
    table.insert_written([key(2)], [3])
    assert policy.get(key(1)) is block is table.get(key(1)) and policy.get(key(2)) is table.get(key(2))
    assert table.victims(8) == policy.victims(8) == [key(1)]  # (key 2 is being written)
    assert policy.evict(1, set()) == [(key(1), block)] and table.pinned_keys() == {key(2)}
