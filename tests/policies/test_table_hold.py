"""`BlockTable.hold` and its release, `hold(keys, False)` (a session's retention), on every table a
tier can have: the compiled table (with the lru and prefix-freq orders), `PureTable` (with the
pure lru and prefix-freq, ARC and SIEVE orders) and `PolicyTable` over a policy written to vLLM's
five methods. A held block is pinned whatever its `ref_cnt`: never a victim,
never evicted, not counted as evictable; it stays held through loads and writes that end, and is
evictable again only once unheld and unpinned."""

from __future__ import annotations

import pytest

from kvtier.index import table_of
from kvtier.policies.arc import ARCCachePolicy
from kvtier.policies.base import with_key_index
from kvtier.policies.lru_compiled import LRUCachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.policies.prefix_compiled import PrefixFreqCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.policies.sieve import SIEVECachePolicy
from tests.policies.seed_policy import SeedLRUPolicy

POLICIES = [LRUCachePolicy, PrefixFreqCachePolicy, PureLRUCachePolicy, PurePrefixFreqCachePolicy, ARCCachePolicy,
            SIEVECachePolicy, SeedLRUPolicy]


def test_every_kind_of_table_is_covered():
    kinds = {type(table_of(with_key_index(policy_class(4)))).__name__ for policy_class in POLICIES}
    assert kinds == {"CompactTable", "PureTable", "PolicyTable"}


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def readable_table(policy_class, n: int = 6):
    """A table of `n` readable blocks, key(i) in slot i, inserted oldest first."""
    table = table_of(with_key_index(policy_class(16)))
    keys = [key(i) for i in range(n)]
    table.insert_written(keys, list(range(n)))
    assert table.mark_written(keys)
    return table, keys


@pytest.mark.parametrize("policy_class", POLICIES, ids=lambda c: c.__name__)
def test_a_held_block_is_never_a_victim_and_not_evictable(policy_class):
    table, keys = readable_table(policy_class)
    table.hold(keys[:3])
    assert table.pinned_keys() == set(keys[:3])
    assert table.evictable_count() == 3
    assert not set(table.victims(6)) & set(keys[:3])
    assert table.evict_ids(4, set()) is None  # (three evictable blocks only: nothing changes)
    assert len(table) == 6
    evicted, _ = table.evict_ids(3, set())
    assert sorted(evicted) == keys[3:]
    assert sorted(table.keys()) == keys[:3]


@pytest.mark.parametrize("policy_class", POLICIES, ids=lambda c: c.__name__)
def test_a_held_block_stays_held_when_its_load_or_write_ends(policy_class):
    table, keys = readable_table(policy_class, 2)
    table.hold(keys[:1])
    assert table.pin_loads(keys) is not None
    table.release_loads(keys)
    assert table.pinned_keys() == {keys[0]}
    new = key(9)
    table.insert_written([new], [9])
    table.hold([new])
    assert table.mark_written([new])
    assert table.pinned_keys() == {keys[0], new}
    assert table.evictable_count() == 1


@pytest.mark.parametrize("policy_class", POLICIES, ids=lambda c: c.__name__)
def test_releasing_a_hold_makes_a_block_evictable_once_no_load_pins_it(policy_class):
    table, keys = readable_table(policy_class, 3)
    table.hold(keys)
    assert table.pin_loads(keys[:1]) is not None
    table.hold(keys, False)
    assert table.pinned_keys() == {keys[0]}  # (still read by a load)
    table.release_loads(keys[:1])
    assert table.pinned_keys() == set() and table.evictable_count() == 3
    evicted, _ = table.evict_ids(3, set())
    assert sorted(evicted) == keys


@pytest.mark.parametrize("policy_class", POLICIES, ids=lambda c: c.__name__)
def test_hold_skips_absent_keys_and_a_forgotten_block_is_not_held_again(policy_class):
    table, keys = readable_table(policy_class, 2)
    table.hold([key(7), keys[0]])
    table.forget([keys[0]])
    assert table.pinned_keys() == set()
    table.insert_written([keys[0]], [0])
    assert table.mark_written([keys[0]])
    assert table.pinned_keys() == set() and table.evictable_count() == 2
    table.hold([keys[0], key(7)], False)  # (not held: nothing changes)
    assert table.evictable_count() == 2
