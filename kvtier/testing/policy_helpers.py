"""What `PolicyTests` builds policies' inputs from and observes them through (no test framework).

Everything is observed through the public contract only: which keys are resident and their
block objects (`keys`, `get`), `len`, the eviction order (`victims`) and what `evict`
returns. `probe` replays a fixed sequence so that hidden state (ghosts, frequencies) shows in
decisions: two policies with equal probes are indistinguishable from then on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtier.core.keys import OffloadKey, make_offload_key
from kvtier.core.types import BlockStatus
from kvtier.policies.base import CachePolicy
from kvtier.testing import policy_contract as contract


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
    the object itself and, for a policy returning views, through `get` (the object is a copy),
    then, when the block stops or starts being evictable (`ref_cnt` leaves or reaches 0), the
    block table's notice (`evictable([k], flag)`), which a policy may count by."""
    was = block.ref_cnt
    block.ref_cnt = value
    if policy.returns_views:
        held = policy.get(k)
        assert held is not None and held.block_id == block.block_id, \
            f"{contract.GET}: get({k!r}) lost block {block.block_id}"
        held.ref_cnt = value
    if (was == 0) != (value == 0):
        policy.evictable([k], value == 0)


def same_block(policy: CachePolicy, got: Any, expected: BlockStatus) -> bool:
    """Whether `got` (from `get`, `evict`) is the block inserted as
    `expected`: the object itself, or for a policy returning views, one with its values."""
    if not policy.returns_views:
        return got is expected
    return got is not None and (got.block_id, got.ref_cnt) == (expected.block_id, expected.ref_cnt)


def observe(policy: CachePolicy, by_identity: bool = True):
    """What the contract lets anyone see: resident key -> block (the object itself, or its slot
    number when comparing twins that hold distinct but equal blocks; a view's values), size,
    eviction order. Asking `victims` twice must give the same order (it changes nothing)."""
    views = policy.returns_views
    resident = {k: (b.block_id, b.ref_cnt) if views else id(b) if by_identity else b.block_id
                for k in policy.keys() if (b := policy.get(k)) is not None}
    order = policy.victims(len(policy))
    assert policy.victims(len(policy)) == order, f"{contract.CANDIDATES_PURE}: a second victims() gave another order"
    return resident, len(policy), order


def values_of(victims) -> list | None:
    """`evict`'s answer as comparable values (views of two policies are distinct objects)."""
    return None if victims is None else [(k, b.block_id, b.ref_cnt) for k, b in victims]


def victim_keys_of(victims) -> list[OffloadKey] | None:
    """The keys of `evict`'s answer (None stays None)."""
    return None if victims is None else [k for k, _ in victims]


# The probe a policy and its twin both get: touches, fresh and returning keys, then evictions
# one at a time until nothing is left, so hidden history (ghosts, frequencies) shows in decisions.
_PROBE_IDS = (1000, 1001, 1002, 1003)


def probe(policy: CachePolicy, capacity: int, returning: list[int]) -> list:
    """Decisions of `policy` under a fixed sequence (never beyond `capacity`), as comparable data."""
    trace: list = []
    policy.touch(sorted(policy.keys())[:2])
    trace.append(observe(policy, by_identity=False))
    for j, i in enumerate(list(_PROBE_IDS) + returning):
        if policy.get(key(i)) is not None:
            continue
        if len(policy) >= capacity:
            trace.append(victim_keys_of(policy.evict(1, set())))
            if len(policy) >= capacity:
                continue
        policy.insert(key(i), ready(10_000 + j))
        trace.append(observe(policy, by_identity=False))
    while len(trace) < 1000:
        trace.append(victim_keys_of(policy.evict(1, set())))
        if trace[-1] is None:
            break
    return trace
