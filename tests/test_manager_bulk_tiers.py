"""Compiled policies and their pure-Python twins make the multi-tier paths (demotions,
promotions and the ends of their jobs) answer and change the same, through public calls only.

The machines of tests/test_manager_bulk.py drive two hierarchies with the same random requests;
here every tier of the second one has the pure-Python twin of the first one's policy, so its
demotions, promotions and job ends go through `CachePolicy`'s default batch calls (over `get`)
where the first one's run in C. After every step both must hold the same blocks in the same
eviction order with the same `ref_cnt`s, pins, clean sets, promotions and counters, and the
copies waiting in the router must read and write the same slots. Copies finish when the machine
says so, or fail (demotions and promotions that fail, blocks dropped or kept by `still_valid`).
Hierarchies: two or three memory tiers cascading on eviction or writing through; first tiers with
the compiled `lru` and `prefix-freq` and a pure-Python policy; a last tier whose backend extends
`free`, `get_load_store_spec` and `still_valid` as the file tier does (its slot ids come back as
`BlockStatus`es)."""

from __future__ import annotations

import pytest
from conftest import keys
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from test_manager_bulk import CTX, PURE_LRU, PURE_PREFIX, TWINS, UNIVERSE, BulkEqualsPerKey, spec_ids
from test_manager_state import BLOCK, DeferredCopy

from kvtier import CPULoadStoreSpec
from kvtier.config import load_config_text
from kvtier.control.hierarchy import build_hierarchy
from kvtier.control.promotion import expire_stamps
from kvtier.tiers.memory import MemoryBackend


class FileLikeMemory(MemoryBackend):
    """A memory tier that extends what the file tier extends: `free` (it forgets the slot, as the
    file tier's commit log does), `get_load_store_spec` (builds its own spec) and `still_valid`
    (a block survives a failed read when its slot is even), so the batch paths hand it
    `BlockStatus`es of their slot ids."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.freed: list[int] = []

    def free(self, block):
        super().free(block)
        self.freed.append(block.block_id)

    def get_load_store_spec(self, keys, blocks):
        return CPULoadStoreSpec([b.block_id for b in blocks], tier=self.name)

    def still_valid(self, block):
        return block.block_id % 2 == 0


class TiersBatchEqualsEach(BulkEqualsPerKey):
    """`BulkEqualsPerKey` over several tiers, every policy of the second hierarchy a twin."""

    TIERS = (("hot", 6, "lru"), ("warm", 10, "lru"))  # (name, blocks, policy), first to last
    CASCADE = "on_evict"
    LAST_BACKEND = "memory"
    DIRECT = False  # the engine loads the last tier directly (`Tier.direct_load`): loads split over two tiers

    def build(self, twin: bool):
        tiers = [(name, n, TWINS.get(policy, policy) if twin else policy) for name, n, policy in self.TIERS]
        lines = [f"  - {{name: {name}, backend: memory, capacity: {n} blocks, policy: '{policy}', "
                 f"cascade: {self.CASCADE}, reserve: 0.34}}" for name, n, policy in tiers[:-1]]
        name, n, policy = tiers[-1]
        lines.append(f"  - {{name: {name}, backend: '{self.LAST_BACKEND}', capacity: {n} blocks, policy: '{policy}'}}")
        h = build_hierarchy(load_config_text(f"block_bytes: {BLOCK}B\ntiers:\n" + "\n".join(lines) + "\n"))
        h.manager.tiers[-1].direct_load = self.DIRECT
        return h

    @rule(data=st.data())
    def load_resident(self, data):
        """`lookup_and_load` of keys some tier holds (random requests mostly miss at once)."""
        resident = [k for k in UNIVERSE if any(t.policy.get(k) is not None for t in self.bulk.tiers)]
        if resident:
            self.lookup_and_load(data.draw(st.lists(st.sampled_from(resident), min_size=1, max_size=6)))

    def _copies(self, copier):
        return [(s.tier, list(s.block_ids), d.tier, list(d.block_ids)) for _, s, d in copier.queue]

    @invariant()
    def same_copies(self):
        assert self._copies(self.pairs[0][1]) == self._copies(self.pairs[1][1])
        freed = [getattr(h.backends[self.TIERS[-1][0]], "freed", None) for h, _ in self.pairs]
        assert freed[0] == freed[1]


def machine(name, **attrs):
    cls = type(name, (TiersBatchEqualsEach,), attrs)
    case = cls.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    return cls, case


FILE_LIKE = "test_manager_bulk_tiers:FileLikeMemory"
_, TestTiersLRU = machine("TiersLRU")
_, TestTiersPrefix = machine("TiersPrefix", TIERS=(("hot", 6, "prefix-freq"), ("warm", 10, "lru")))
_, TestTiersPureFirst = machine("TiersPureFirst", TIERS=(("hot", 6, PURE_PREFIX), ("warm", 10, "lru")))
_, TestTiersPureLast = machine("TiersPureLast", TIERS=(("hot", 6, "prefix-freq"), ("warm", 10, PURE_PREFIX)))
_, TestTiersFileLike = machine("TiersFileLike", TIERS=(("hot", 6, "prefix-freq"), ("warm", 10, "lru")),
                               LAST_BACKEND=FILE_LIKE)
_, TestTiersThree = machine("TiersThree", TIERS=(("hot", 5, "lru"), ("mid", 6, "prefix-freq"), ("warm", 9, "lru")),
                            LAST_BACKEND=FILE_LIKE)
_, TestTiersDirect = machine("TiersDirect", DIRECT=True)
_, TestTiersDirectPrefix = machine("TiersDirectPrefix", DIRECT=True, LAST_BACKEND=FILE_LIKE,
                                   TIERS=(("hot", 6, "prefix-freq"), ("warm", 10, "lru")))
_, TestTiersDirectThree = machine("TiersDirectThree", DIRECT=True,
                                  TIERS=(("hot", 5, "lru"), ("mid", 6, "prefix-freq"), ("warm", 9, "lru")))
_, TestTiersDirectMixed = machine("TiersDirectMixed", DIRECT=True, TIERS=(("hot", 6, "lru"), ("warm", 10, PURE_PREFIX)))
_, TestTiersWriteThrough = machine("TiersWriteThrough", CASCADE="on_store")
_, TestTiersThreeWriteThrough = machine("TiersThreeWriteThrough", CASCADE="on_store",
                                        TIERS=(("hot", 5, "prefix-freq"), ("mid", 6, "lru"), ("warm", 9, "lru")))


def _hierarchy(policy: str, backend: str = "memory"):
    h = build_hierarchy(load_config_text(f"""
block_bytes: {BLOCK}B
tiers:
  - {{name: hot, backend: memory, capacity: 4 blocks, policy: '{policy}', reserve: 0.25}}
  - {{name: warm, backend: '{backend}', capacity: 8 blocks, policy: '{policy}'}}
"""))
    copier = DeferredCopy(h.backends)
    h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, copier)
    return h, copier


@pytest.mark.parametrize("backend", ["memory", FILE_LIKE])
@pytest.mark.parametrize("fail", [False, True])
def test_a_demotion_and_a_promotion_through_the_batch_calls(fail, backend):
    """A full first tier demotes its victims to the next one in one job, pinned by slot id, and
    answers None (no room yet) instead of evicting a block not copied down; the job's end
    releases the source pins and makes the copies readable (or removes them, and the blocks
    whose copy failed may then go, counted); a key found below is promoted back the same way.
    The compiled `lru` and its pure-Python twin end in the same state."""
    states = []
    for policy in ("lru", PURE_LRU):
        h, copier = _hierarchy(policy, backend)
        try:
            m = h.manager
            hot, warm = m.tiers
            first = keys(4)
            m.complete_store(m.prepare_store(first, CTX).keys_to_store, CTX)
            # the two victims pinned for their copy, none dropped: no room until they are below
            assert m.prepare_store(keys(2, start=100), CTX) is None and hot.stats.cascade_dropped == 0
            assert [(hot.policy.get(k).ref_cnt, warm.policy.get(k).ref_cnt) for k in first[2:]] == [(1, -1)] * 2
            assert sorted(warm.table.pinned_keys()) == sorted(first[2:])
            copier.run(fail)
            m.wait_idle(timeout=5)
            assert [hot.policy.get(k).ref_cnt for k in first[2:]] == [0, 0]
            assert all((warm.policy.get(k) is None) == fail for k in first[2:]) and not warm.table.pinned_keys()
            out = m.prepare_store(keys(2, start=100), CTX)  # copied down (or failed): they may go now
            assert sorted(out.evicted_keys) == sorted(first[2:])
            assert hot.stats.cascade_dropped == hot.stats.cascade_dropped_failed == (2 if fail else 0)
            m.complete_store(out.keys_to_store, CTX)
            m.on_schedule_end()
            if not fail:  # below only now: promoted back once tier 0's next victims are copied down
                assert hot.policy.get(first[2]) is None and m.lookup(first[2], CTX).name == "RETRY"
                m.on_schedule_end()
                copier.run(False)
                assert m.lookup(first[2], CTX).name == "RETRY"  # (queued while room was made)
                m.on_schedule_end()
                assert (hot.policy.get(first[2]).ref_cnt, warm.policy.get(first[2]).ref_cnt) == (-1, 1)
                copier.run(False)
                assert m.lookup(first[2], CTX).name == "HIT" and warm.policy.get(first[2]).ref_cnt == 0
                assert warm.stats.promotions == 1 and first[2] in hot.clean
            states.append([(t.name, sorted((k, t.policy.get(k).ref_cnt, t.policy.get(k).block_id)
                                           for k in t.policy.keys()), sorted(t.table.pinned_keys()),
                            sorted(t.clean), t.stats.as_dict()) for t in m.tiers])
        finally:
            copier.run(fail=True)
            h.close()
    assert states[0] == states[1]


def _state(m) -> list:
    return [(t.name, sorted((k, t.policy.get(k).ref_cnt, t.policy.get(k).block_id) for k in t.policy.keys()),
             sorted(t.table.pinned_keys()), sorted(t.clean), t.stats.as_dict()) for t in m.tiers] + [
        [m.load_source(k) for k in UNIVERSE]]


def test_a_promotion_longer_than_the_room_left_through_the_batch_calls():
    """A run of six keys below, with room for one in the first tier (two blocks pinned by a load,
    one by its copy down): the first is promoted, the other five are released in their tier and
    wait (RETRY) for the room the copy down makes, then are refused once no copy makes more; the
    compiled `lru` and its pure-Python twin alike."""
    states = []
    for policy in ("lru", PURE_LRU):
        h, copier = _hierarchy(policy)
        try:
            m = h.manager
            hot, warm = m.tiers
            run, loaded = keys(6), keys(2, start=100)
            for key in run + keys(2, start=50) + loaded:  # one by one, each copy down done
                m.complete_store(m.prepare_store([key], CTX).keys_to_store, CTX)
                copier.run(False)
                m.on_schedule_end()
                copier.run(False)
                m.wait_idle(timeout=5)
            m.prepare_load(loaded, CTX)
            assert all(warm.policy.get(k) is not None and hot.policy.get(k) is None for k in run)
            assert [m.lookup(k, CTX).name for k in run] == ["RETRY"] * 6
            m.on_schedule_end()
            assert [k for k in run if hot.policy.get(k) is not None] == run[:1]
            assert [warm.policy.get(k).ref_cnt for k in run] == [1, 0, 0, 0, 0, 0]
            assert [m.lookup(k, CTX).name for k in run] == ["RETRY"] * 6  # (room is being made)
            for _ in range(8):  # steps until no copy makes room any more
                copier.run(False)
                m.on_schedule_end()
            assert not m.has_pending_work() and hot.stats.cascade_dropped == 0
            answers = [m.lookup(k, CTX).name for k in run]
            assert answers[:2] == ["HIT", "HIT"] and set(answers[2:]) <= {"MISS", "RETRY"}
            states.append(_state(m))
        finally:
            copier.run(fail=True)
            h.close()
    assert states[0] == states[1]


def test_victims_already_below_become_clean_without_a_copy():
    """Victims whose copy below is readable but not recorded as clean (the record lost) are
    recorded clean and not copied again; the compiled `lru` and its pure-Python twin alike."""
    states = []
    for policy in ("lru", PURE_LRU):
        h, copier = _hierarchy(policy)
        try:
            m = h.manager
            hot, warm = m.tiers
            first = keys(4)
            m.complete_store(m.prepare_store(first, CTX).keys_to_store, CTX)
            assert m.prepare_store(keys(2, start=100), CTX) is None  # (the victims' copies start)
            copier.run(False)
            m.wait_idle(timeout=5)
            assert sorted(hot.clean) == sorted(first[2:])
            hot.clean.clear()
            demotions = warm.stats.stores
            out = m.prepare_store(keys(2, start=100), CTX)
            assert sorted(out.evicted_keys) == sorted(first[2:])  # evicted as clean: not counted as dropped
            assert warm.stats.stores == demotions and hot.stats.cascade_dropped == 0
            states.append(_state(m))
        finally:
            copier.run(fail=True)
            h.close()
    assert states[0] == states[1]


def _expire_one_by_one(stamps, before, most):
    """`promotion.expire_stamps` as it was: the oldest entry, one at a time."""
    while stamps:
        key, when = next(iter(stamps.items()))
        if when >= before and len(stamps) <= most:
            return
        del stamps[key]


@given(gaps=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5]), max_size=12), before=st.floats(-1, 20),
       most=st.integers(0, 14))
def test_expire_counts_in_c_what_one_by_one_drops(gaps, before, most):
    """`expire_stamps` (the leading stale run counted by `takewhile`) leaves what dropping the oldest
    entry one at a time leaves, on time-ordered stamps (ties included)."""
    now, stamps = 0.0, {}
    for i, gap in enumerate(gaps):
        now += gap
        stamps[bytes([i])] = now
    want = dict(stamps)
    _expire_one_by_one(want, before, most)
    expire_stamps(stamps, before, most)
    assert list(stamps.items()) == list(want.items())


@pytest.mark.parametrize("order", ["below_first", "top_first", "mixed", "below_only"])
@pytest.mark.parametrize("promoted", [False, True])
def test_a_load_from_tier_0_and_a_tier_loaded_directly(order, promoted):
    """A load of blocks of tier 0 and of a tier the engine loads directly, in any order, pins,
    credits, answers and releases the same with the compiled `lru` and its pure-Python twin."""
    states = []
    for policy in ("lru", PURE_LRU):
        h, copier = _hierarchy(policy)
        try:
            m = h.manager
            hot, warm = m.tiers
            warm.direct_load = True
            stored = keys(8)
            for key in stored:  # one by one, each copy down done: the first four end up below only
                m.complete_store(m.prepare_store([key], CTX).keys_to_store, CTX)
                copier.run(False)
                m.on_schedule_end()
                copier.run(False)
                m.wait_idle(timeout=5)
            if promoted:
                hot.promoted_from[stored[5]] = 1  # (as if promoted from below and not loaded yet)
            below, top = stored[:4], stored[4:]
            assert all(hot.policy.get(k) is None and warm.policy.get(k) is not None for k in below)
            load = {"below_first": below[:2] + top[:2], "top_first": top[:3] + below[:3],
                    "mixed": [top[0], below[0], top[1], below[1], below[2]], "below_only": below[:3]}[order]
            assert m.lookup_run(load, CTX) == (len(load), None)
            spec = m.prepare_load(load, CTX)
            taken = _state(m)
            m.complete_load(load, CTX)
            assert not any(t.table.pinned_keys() for t in m.tiers)  # every load pin released
            states.append((spec_ids(spec), taken, _state(m)))
        finally:
            copier.run(fail=True)
            h.close()
    assert states[0] == states[1]
    assert states[0][1] != states[0][2]  # (the load pinned and credited something)
