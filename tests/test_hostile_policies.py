"""A user's policy (`policy: package.module:Class`) whose `evict` breaks its contract (exactly `n`
distinct resident blocks, `ref_cnt == 0`, not protected, removed from the policy) makes the store
that needed the room fail with `PolicyError` naming the tier and the policy's class: no slot is
freed, the block table and the policy still agree, and every block that loads has the bytes stored.

Before the fix the answer was taken as it came: duplicate victims freed one slot twice (26 blocks
resident in an 8-block tier, wrong bytes served), made-up victims freed slots of other blocks,
victims being written had their slots handed to another request, and a wrong count or type
failed half-way (a bare `RuntimeError` or `ValueError`) with the table and the policy disagreeing.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from conftest import keys, memory_hierarchy

from kvtier import CachePolicy, ReqContext, load_config_text
from kvtier.core.errors import PolicyError
from kvtier.core.types import BlockStatus

torch = pytest.importorskip("torch")

from test_nothing_lost import make_kv  # noqa: E402

CAPACITY = 8


class GoodLRU(CachePolicy):
    """A small LRU to vLLM's five methods and `victims` (a user's policy, wrapped in `KeyIndex`)."""

    def __init__(self, cache_capacity):
        super().__init__(cache_capacity)
        self.blocks = OrderedDict()

    def get(self, key):
        return self.blocks.get(key)

    def insert(self, key, block):
        self.blocks[key] = block

    def remove(self, key):
        self.blocks.pop(key, None)

    def touch(self, keys):
        for k in reversed(list(keys)):
            if k in self.blocks:
                self.blocks.move_to_end(k)

    def candidates(self, protected):
        return [(k, b) for k, b in self.blocks.items() if b.ref_cnt == 0 and k not in protected]

    def evict(self, n, protected):
        if n <= 0:
            return []
        found = self.candidates(protected)
        if len(found) < n:
            return None
        for k, _ in found[:n]:
            del self.blocks[k]
        return found[:n]

    def victims(self, n, skip=()):
        return [k for k, _ in self.candidates(set(skip))][:max(n, 0)]


class Duplicates(GoodLRU):
    """Names its first victim `n` times (removing it once)."""

    def evict(self, n, protected):
        got = super().evict(1, protected) if n > 0 else []
        return None if got is None else got * n


class OwnKeys:
    """`keys` and `len` of a policy's own (it is not wrapped in `KeyIndex`)."""

    def keys(self):
        return list(self.blocks)

    def __len__(self):
        return len(self.blocks)


class DuplicatesOwnKeys(OwnKeys, Duplicates):
    """`Duplicates`, not wrapped in `KeyIndex`."""


class NotResident(GoodLRU):
    """Names made-up keys in slot 0, removing nothing."""

    def evict(self, n, protected):
        return [(bytes([7]) * 8 + i.to_bytes(4, "big"), BlockStatus(0)) for i in range(n)]


class TooFew(GoodLRU):
    """Removes `n` blocks, names `n - 1`."""

    def evict(self, n, protected):
        got = super().evict(n, protected)
        return got[:-1] if got else got


class TooMany(GoodLRU):
    """Removes and names `n + 2` blocks."""

    def evict(self, n, protected):
        got = super().evict(n + 2, protected) if n > 0 else []
        return got if got is not None else super().evict(n, protected)


class WrongType(GoodLRU):
    """Returns the keys only, not `(key, block)` pairs."""

    def evict(self, n, protected):
        got = super().evict(n, protected)
        return None if got is None else [k for k, _ in got]


class KeepsVictims(GoodLRU):
    """Names the right victims but keeps them."""

    def evict(self, n, protected):
        return self.candidates(protected)[:n] if n <= len(self.candidates(protected)) else None


class DropsAnother(OwnKeys, GoodLRU):
    """Names `n` victims, and drops one more without saying (seen by its `len`: wrapped in
    `KeyIndex`, whose `len` counts what went in and what was named, it would not be)."""

    def evict(self, n, protected):
        got = super().evict(n, protected)
        if got and self.blocks:
            self.blocks.popitem(last=True)
        return got


class IgnoresPins(GoodLRU):
    """Takes blocks whatever their `ref_cnt` (being written, read)."""

    def evict(self, n, protected):
        if n <= 0:
            return []
        out = [(k, b) for k, b in self.blocks.items() if k not in protected][:n]
        if len(out) < n:
            return None
        for k, _ in out:
            del self.blocks[k]
        return out


HOSTILE = [Duplicates, DuplicatesOwnKeys, NotResident, TooFew, TooMany, WrongType, KeepsVictims, DropsAnother]


def _store_all(policy: str, n_keys: int = 40, batch: int = 4):
    """Store `n_keys` engine blocks through a standalone cpu tier of `CAPACITY` blocks with
    `policy`, `batch` at a time; the errors raised, the loads' results and the tier's stats."""
    from kvtier.standalone import KVTier

    kv = make_kv(64)
    tensors = [t.tensor for t in kv.tensors]
    stored = [t.clone() for t in tensors]
    ks = keys(n_keys)
    engine = [i % 64 for i in range(n_keys)]
    config = load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: {CAPACITY} blocks, policy: "{policy}", pin: false}}
""")
    tier = KVTier.open(config, kv, model="test/hostile")
    errors, wrong, loaded = [], [], []
    try:
        for s in range(0, n_keys, batch):
            try:
                tier.store(ks[s:s + batch], engine[s:s + batch])
            except PolicyError as exc:
                errors.append(str(exc))
        tier.wait()
        resident = tier.stats()["cpu"]["resident_blocks"]
        for t in tensors:
            t.zero_()
        for i, key in enumerate(ks):
            if tier.load([key], [engine[i]]) == 1:
                loaded.append(i)
                if not all(torch.equal(t[engine[i]], o[engine[i]]) for t, o in zip(tensors, stored)):
                    wrong.append(i)
    finally:
        tier.close(flush_timeout=5)
    return errors, wrong, loaded, resident


@pytest.mark.parametrize("cls", HOSTILE, ids=lambda c: c.__name__)
def test_wrong_evict_answer_fails_the_store_and_serves_no_wrong_byte(cls):
    errors, wrong, loaded, resident = _store_all(f"test_hostile_policies:{cls.__name__}")
    assert errors, "a wrong evict() answer must fail the store"
    assert all("tiers[0] (cpu)" in e and f"test_hostile_policies:{cls.__name__}.evict(" in e for e in errors), errors
    assert wrong == []
    assert resident <= CAPACITY
    assert len(loaded) == CAPACITY  # (the blocks resident before the first refusal: nothing lost)


def test_a_policy_that_keeps_the_contract_still_stores_everything():
    errors, wrong, loaded, resident = _store_all("test_hostile_policies:GoodLRU")
    assert (errors, wrong, resident) == ([], [], CAPACITY)
    assert loaded == list(range(40 - CAPACITY, 40))


def _state(tier) -> tuple:
    """What a refused eviction must leave as it was: each resident key's slot and `ref_cnt`, the
    free slots, and the policy's own answers for the same keys."""
    table = {k: (tier.table.get(k).block_id, tier.table.get(k).ref_cnt) for k in tier.table.keys()}
    policy = {k: (tier.policy.get(k).block_id, tier.policy.get(k).ref_cnt) for k in tier.policy.keys()}
    return table, policy, len(tier.table), len(tier.policy), tier.backend.get_num_free_blocks()


@pytest.mark.parametrize("cls", [*HOSTILE, IgnoresPins], ids=lambda c: c.__name__)
def test_refused_eviction_frees_nothing_and_keeps_table_and_policy_agreeing(cls):
    manager = memory_hierarchy(hot=6, hot_policy=f"test_hostile_policies:{cls.__name__}", cascade="none").manager
    hot = manager.tiers[0]
    first, ctx = keys(6), ReqContext("r1")
    assert manager.prepare_store(first, ctx) is not None
    manager.complete_store(first[:4], ctx)  # (first[4:] still being written, ref_cnt -1: entered first)
    before = _state(hot)
    assert before[0] == before[1] and len(before[0]) == 6
    with pytest.raises(PolicyError, match=rf"tiers\[0\] \(hot\): policy test_hostile_policies:{cls.__name__}\.evict"):
        manager.prepare_store(keys(2, start=10), ReqContext("r2"))
    assert _state(hot) == before
    manager.complete_store(first[4:], ctx)  # (the blocks being written were left in their slots)
    assert [hot.table.get(k).ref_cnt for k in first] == [0] * 6


class NoticeRaises(GoodLRU):
    """Takes the table's notices (`evictable`) and raises on the pin of a load once armed."""

    armed = False

    def evictable(self, keys, flag):
        if NoticeRaises.armed and keys and not flag:
            raise RuntimeError("notice failed")


def test_a_notice_that_raises_on_a_load_leaves_no_pin_behind():
    """Before: the load's pins were taken before the notice raised, and stayed: those blocks could
    never be evicted again (a later store warned that every block is pinned)."""
    manager = memory_hierarchy(hot=4, hot_policy="test_hostile_policies:NoticeRaises", cascade="none").manager
    hot, ctx = manager.tiers[0], ReqContext("r1")
    first = keys(4)
    manager.complete_store(manager.prepare_store(first, ctx).keys_to_store, ctx)
    NoticeRaises.armed = True
    try:
        with pytest.raises(RuntimeError, match="notice failed"):
            manager.prepare_load(first[:2])
    finally:
        NoticeRaises.armed = False
    assert [hot.table.get(k).ref_cnt for k in first] == [0] * 4
    out = manager.prepare_store(keys(4, start=10), ReqContext("r2"))  # (room made by evicting all four)
    assert out is not None and sorted(out.evicted_keys) == sorted(first)


class VictimsRaise(GoodLRU):
    """Names its next victims until armed; then `victims` raises."""

    armed = False

    def victims(self, n, skip=()):
        if VictimsRaise.armed:
            raise RuntimeError("victims failed")
        return super().victims(n, skip)


def test_victims_raising_after_a_store_took_its_slots_leaves_no_slot_being_written():
    """`victims` is asked after a store's slots are allocated, to keep the reserve clean. Before:
    when it raised, the store failed and its slots stayed "being written" for good."""
    manager = memory_hierarchy(hot=8, hot_policy="test_hostile_policies:VictimsRaise", reserve=0.25).manager
    hot, ctx = manager.tiers[0], ReqContext("r1")
    first = keys(6)
    manager.complete_store(manager.prepare_store(first, ctx).keys_to_store, ctx)
    manager.wait_idle(10)
    VictimsRaise.armed = True
    try:
        with pytest.raises(RuntimeError, match="victims failed"):
            manager.prepare_store(keys(1, start=10), ReqContext("r2"))  # (room: only the reserve asks victims)
    finally:
        VictimsRaise.armed = False
    assert hot.table.get(keys(1, start=10)[0]) is None and hot.backend.get_num_free_blocks() == 2
    assert sorted(hot.table.keys()) == sorted(first)
    out = manager.prepare_store(keys(1, start=10), ReqContext("r3"))
    assert out is not None and out.keys_to_store == keys(1, start=10)
