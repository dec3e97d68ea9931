"""What the compiled indexes (`lru`, `prefix-freq`) allocate: a key costs its own length (a long
one has an allocation of its own, issue 27.4), the arrays grow as blocks arrive instead of being
sized by the capacity up front (27.3), and a block of the usual 36-byte key still costs what
docs/policies.md says. Their decisions with long keys are checked against the pure classes by the
differential tests (test_compact_lru.py, test_compact_prefix.py), whose keys include long ones."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.core.types import BlockStatus
from kvtier.policies.lru_compiled import LRUCachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.policies.prefix_compiled import PrefixFreqCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy

COMPILED = [LRUCachePolicy, PrefixFreqCachePolicy]
PURE = {LRUCachePolicy: PureLRUCachePolicy, PrefixFreqCachePolicy: PurePrefixFreqCachePolicy}


def vllm_key(i: int) -> bytes:
    """A 32-byte block hash and a 4-byte group, as vLLM makes them."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (i % 3).to_bytes(4, "big")


def long_keys(n: int = 200, longest: int = 60_000) -> list[bytes]:
    """`n` distinct keys from 36 bytes up to `longest` bytes."""
    return [vllm_key(i) + bytes([i % 251]) * (i * (longest - 36) // (n - 1)) for i in range(n)]


def fill(policy, keys: list[bytes]) -> None:
    policy.insert_many(keys, [BlockStatus(i) for i in range(len(keys))])
    for k in keys:
        policy.get(k).ref_cnt = 0


@pytest.mark.parametrize("capacity", [100_000, 1 << 30])
@pytest.mark.parametrize("cls", COMPILED, ids=lambda c: c.__name__)
def test_a_long_key_costs_its_own_length(cls, capacity):
    """200 keys of up to 60 KB in an index of 100,000 (or 2^30) blocks: about their own bytes
    (12 MB), where the key array used to be capacity x the longest key (6 GB: MemoryError)."""
    keys = long_keys()
    compiled, pure = cls(capacity), PURE[cls](capacity)
    fill(compiled, keys)
    fill(pure, keys)
    assert compiled.memory_bytes() < sum(map(len, keys)) + (1 << 20)
    assert sorted(compiled.keys()) == sorted(keys)
    assert all(compiled.get(k).block_id == i for i, k in enumerate(keys))
    evicted = compiled.evict(150, set(keys[:10]))
    assert [k for k, _ in evicted] == [k for k, _ in pure.evict(150, set(keys[:10]))]
    assert all(compiled.get(k) is None for k, _ in evicted) and len(compiled) == 50
    compiled.insert_many([k for k, _ in evicted[:20]], [BlockStatus(1000 + i) for i in range(20)])
    assert len(compiled) == 70 and compiled.get(evicted[0][0]).block_id == 1000


@pytest.mark.parametrize("cls", COMPILED, ids=lambda c: c.__name__)
def test_the_long_keys_are_freed_when_their_blocks_leave(cls):
    """Evicted, removed or cleared, a long key's allocation is no longer counted (nor kept)."""
    keys = long_keys(50, 10_000)
    p = cls(1000)
    fill(p, keys)
    empty = p.memory_bytes() - sum(len(k) for k in keys if len(k) > 64)
    p.evict(20, set())
    p.remove(keys[30])
    assert p.memory_bytes() == empty + sum(len(k) for k in keys[20:] if len(k) > 64 and k != keys[30])
    p.clear()
    assert p.memory_bytes() == empty and len(p) == 0


@pytest.mark.parametrize("cls", COMPILED, ids=lambda c: c.__name__)
def test_a_large_capacity_allocates_as_blocks_arrive(cls):
    """An index of 2^30 blocks (the compiled limit) costs nothing until blocks arrive (it used to
    allocate its arrays up front: 40 GB of entries, MemoryError on this machine)."""
    p = cls(1 << 30)
    assert p.memory_bytes() < (1 << 20)
    keys = [vllm_key(i) for i in range(5000)]
    fill(p, keys)
    assert len(p) == 5000 and p.memory_bytes() < 5000 * 200
    with pytest.raises(ValueError, match=r"<= 1073741824 blocks"):
        cls((1 << 30) + 1)


@pytest.mark.parametrize(("cls", "most"), [(LRUCachePolicy, 84.5), (PrefixFreqCachePolicy, 92.5)],
                         ids=["lru", "prefix-freq"])
def test_a_block_of_a_vllm_key_costs_what_it_did(cls, most):
    """1M resident blocks of 36-byte keys: the arrays grown to the capacity, no further (84.4 and
    92.4 bytes per block before keys and capacities changed; docs/policies.md)."""
    n = 1_000_000
    p = cls(n)
    p.evictable((), False)
    for start in range(0, n, 1 << 16):
        fill(p, [vllm_key(i) for i in range(start, min(n, start + (1 << 16)))])
    assert len(p) == n
    assert p.memory_bytes() / n <= most
