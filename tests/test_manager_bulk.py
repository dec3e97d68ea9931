"""A compiled policy and its pure-Python twin give the manager the same answers and state.

Two hierarchies take the same random requests through public calls only: the first with a
compiled policy in its first tier (the registered `lru`, or `prefix-freq`), whose block table is
compiled (`CompactTable`), the second with its pure-Python twin (`PureLRUCachePolicy`,
`PurePrefixFreqCachePolicy`), whose block table is the pure `PureTable`, or with the twin behind
`PolicyTable` (`AdaptedLRU`, `AdaptedPrefix`: one of vLLM's calls overridden, as a policy written
to vLLM's contract goes through `get`, `insert_many`, `evict`). The first looks a request up with
`lookup_run` and touches a batch at once, the second key by key (`lookup` per key, `touch` per
key). After every step both must hold the same blocks in the same eviction order with the same
`ref_cnt`s, pins, promotions and counters. Batches repeat keys and mix tiers, so every case of
the load path runs."""

from __future__ import annotations

import pytest
from conftest import keys, memory_hierarchy
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_manager_state import BLOCK, DeferredCopy

from kvtier import CPULoadStoreSpec, LookupResult, ReqContext
from kvtier.config import load_config_text
from kvtier.control.hierarchy import build_hierarchy
from kvtier.index import PolicyTable, PureTable
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy

PURE_LRU = "kvtier.policies.lru_pure:PureLRUCachePolicy"
PURE_PREFIX = "kvtier.policies.prefix_pure:PurePrefixFreqCachePolicy"
TWINS = {"lru": PURE_LRU, "prefix-freq": PURE_PREFIX}  # a compiled policy -> its pure-Python twin
ADAPTED = {"lru": "test_manager_bulk:AdaptedLRU", "prefix-freq": "test_manager_bulk:AdaptedPrefix"}
UNIVERSE = keys(16)
CTX = ReqContext("bulk")


class AdaptedLRU(PureLRUCachePolicy):
    """The pure LRU with `touch` overridden: its tier's block table is `PolicyTable` over it."""

    def touch(self, keys) -> None:
        super().touch(keys)


class AdaptedPrefix(PurePrefixFreqCachePolicy):
    """The pure prefix-freq with `touch` overridden (`PolicyTable` over it)."""

    def touch(self, keys) -> None:
        super().touch(keys)


def per_key_run(manager, request) -> tuple[int, LookupResult | None]:
    """What `lookup_run` must answer: `lookup` key by key up to the first non-HIT."""
    for n, key in enumerate(request):
        result = manager.lookup(key, CTX)
        if result is not LookupResult.HIT:
            return n, result
    return len(request), None


def spec_ids(spec) -> tuple:
    """A load's spec in a comparable form: its type and slots, per part of a composite one."""
    parts = getattr(spec, "parts", None)
    if parts is not None:
        return type(spec), [(spec_ids(part), list(positions)) for part, positions in parts]
    return type(spec), spec.tier, list(spec.block_ids)


def state(manager) -> list:
    """Everything the bulk paths may change, per tier, in a comparable form."""
    rows = []
    for tier in manager.tiers:
        policy = tier.table
        order = policy.victims(len(policy))
        blocks = sorted((k, policy.get(k).ref_cnt, policy.get(k).block_id) for k in policy.keys())
        rows.append((tier.name, order, blocks, sorted(policy.pinned_keys() or ()), sorted(tier.clean),
                     dict(tier.promoted_from), tier.stats.as_dict()))
    return [rows, [manager.load_source(k) for k in UNIVERSE]]


class BulkEqualsPerKey(RuleBasedStateMachine):
    HIERARCHY = dict(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy="lru")
    ONE_TIER = False  # True: the first tier alone (`lookup_run` answers without `lookup`)
    TWINS = TWINS  # the second hierarchy's policy per first one's
    TWIN_TABLE = PureTable  # the block table of the second hierarchy's first tier

    def build(self, twin: bool):
        """The first hierarchy (`twin` False) or the second, with the pure-Python twins."""
        hierarchy = dict(self.HIERARCHY)
        if twin:
            hierarchy["hot_policy"] = self.TWINS.get(hierarchy["hot_policy"], hierarchy["hot_policy"])
        if not self.ONE_TIER:
            return memory_hierarchy(**hierarchy)
        return build_hierarchy(load_config_text(f"""
block_bytes: {BLOCK}B
tiers:
  - {{name: hot, backend: memory, capacity: {hierarchy['hot']} blocks, policy: '{hierarchy['hot_policy']}'}}
"""))

    def __init__(self):
        super().__init__()
        self.pairs = []
        for twin in (False, True):
            h = self.build(twin)
            copier = DeferredCopy(h.backends)
            h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, copier)
            self.pairs.append((h, copier))
        self.bulk, self.each = (h.manager for h, _ in self.pairs)
        assert type(self.each.tiers[0].table) is self.TWIN_TABLE
        self.pending: list[list[bytes]] = []
        self.loads: list[list[bytes]] = []

    def teardown(self):
        for h, copier in self.pairs:
            copier.run(fail=True)
            h.router.poll()

    @rule(request=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=6))
    def lookup_and_load(self, request):
        got = self.bulk.lookup_run(request, CTX)
        assert got == per_key_run(self.each, request)
        hits = request[:got[0]]
        if hits:
            a = self.bulk.prepare_load(hits, CTX)
            b = self.each.prepare_load(list(hits), CTX)
            assert spec_ids(a) == spec_ids(b)
            self.loads.append(hits)

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), touch=st.booleans())
    def complete_load(self, data, touch):
        hits = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.bulk.complete_load(hits, CTX)
        self.each.complete_load(list(hits), CTX)
        if touch:
            self.bulk.touch(hits, CTX)
            for key in reversed(hits):  # the per-key touch: the first key ends up the most recent
                self.each.touch([key], CTX)

    @rule(picks=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4, unique=True))
    def prepare_store(self, picks):
        outs = [m.prepare_store(picks, CTX) for m in (self.bulk, self.each)]
        assert (outs[0] is None) == (outs[1] is None)
        if outs[0] is not None:
            assert outs[0].keys_to_store == outs[1].keys_to_store
            self.pending.append(outs[0].keys_to_store)

    @precondition(lambda self: self.pending)
    @rule(success=st.booleans())
    def complete_store(self, success):
        stored = self.pending.pop(0)
        for m in (self.bulk, self.each):
            m.complete_store(stored, CTX, success=success)

    @rule(fail=st.booleans())
    def finish_transfers(self, fail):
        for _, copier in self.pairs:
            copier.run(fail)

    @rule()
    def end_step(self):
        for m in (self.bulk, self.each):
            m.on_schedule_end()

    @invariant()
    def same_state(self):
        assert state(self.bulk) == state(self.each)


class BulkEqualsPerKeyPrefix(BulkEqualsPerKey):
    HIERARCHY = dict(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy="prefix-freq")


class BulkEqualsPerKeyPure(BulkEqualsPerKey):
    """Both hierarchies pure-Python: `lookup_run` and batches against `lookup` and single keys."""

    HIERARCHY = dict(BulkEqualsPerKey.HIERARCHY, hot_policy=PURE_LRU)


class BulkEqualsPerKeyAdapted(BulkEqualsPerKey):
    """The compiled `lru` against the pure LRU behind `PolicyTable`."""

    TWINS = ADAPTED
    TWIN_TABLE = PolicyTable


class BulkEqualsPerKeyAdaptedPrefix(BulkEqualsPerKeyAdapted):
    HIERARCHY = BulkEqualsPerKeyPrefix.HIERARCHY


class OneTierBulkEqualsPerKey(BulkEqualsPerKey):
    ONE_TIER = True


class OneTierBulkEqualsPerKeyPrefix(BulkEqualsPerKey):
    HIERARCHY = BulkEqualsPerKeyPrefix.HIERARCHY
    ONE_TIER = True


FAST = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestBulkLRU = BulkEqualsPerKey.TestCase
TestBulkLRU.settings = FAST
TestBulkPrefix = BulkEqualsPerKeyPrefix.TestCase
TestBulkPrefix.settings = FAST
TestBulkPureLRU = BulkEqualsPerKeyPure.TestCase
TestBulkPureLRU.settings = FAST
TestBulkAdaptedLRU = BulkEqualsPerKeyAdapted.TestCase
TestBulkAdaptedLRU.settings = FAST
TestBulkAdaptedPrefix = BulkEqualsPerKeyAdaptedPrefix.TestCase
TestBulkAdaptedPrefix.settings = FAST
TestOneTierBulkLRU = OneTierBulkEqualsPerKey.TestCase
TestOneTierBulkLRU.settings = FAST
TestOneTierBulkPrefix = OneTierBulkEqualsPerKeyPrefix.TestCase
TestOneTierBulkPrefix.settings = FAST


LRUS = pytest.mark.parametrize("lru", ["lru", PURE_LRU], ids=["compiled", "pure"])


@LRUS
def test_lookup_run_stops_at_the_first_miss_and_loads_in_one_batch(lru):
    h = memory_hierarchy(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy=lru)
    m = h.manager
    a, b, c = UNIVERSE[:3]
    out = m.prepare_store([a, b], CTX)
    m.complete_store(out.keys_to_store, CTX)
    assert m.lookup_run([a, b, c, a], CTX) == (2, LookupResult.MISS)
    assert m.lookup_run([a, b], CTX) == (2, None)
    assert m.lookup_run([], CTX) == (0, None)
    spec = m.prepare_load([a, b], CTX)
    assert [m.tiers[0].policy.get(k).ref_cnt for k in (a, b)] == [1, 1]
    assert list(spec.block_ids) == [m.tiers[0].policy.get(k).block_id for k in (a, b)]
    m.complete_load([a, b], CTX)
    assert [m.tiers[0].policy.get(k).ref_cnt for k in (a, b)] == [0, 0]
    assert m.tiers[0].stats.hits == 2
    with pytest.raises(KeyError):
        m.complete_load([a], CTX)
    with pytest.raises(KeyError):
        m.prepare_load([c], CTX)


@LRUS
@pytest.mark.parametrize("miss_at", [0, 1, 2, 15, 16, 17, 48, 49, 100, 150])
@pytest.mark.parametrize("pending_at", [None, 20, 60])
def test_lookup_run_over_several_chunks_equals_per_key(miss_at, pending_at, lru):
    """A long request that stops anywhere (a miss, a block still being written) gets from
    `lookup_run` the per-key answer."""
    h = memory_hierarchy(hot=200, warm=400, block_bytes=BLOCK, hot_policy=lru)
    try:
        stored = keys(150)
        out = h.manager.prepare_store(stored, CTX)
        h.manager.complete_store(out.keys_to_store, CTX)
        request = stored[:miss_at] + keys(1, start=10_000) + stored[miss_at:]
        if pending_at is not None:
            pending = keys(1, start=20_000)
            h.manager.prepare_store(pending, CTX)  # being written: HIT_PENDING until completed
            request.insert(pending_at, pending[0])
        want = per_key_run(h.manager, request)
        assert h.manager.lookup_run(request, CTX) == want
        assert want[0] == min(miss_at, pending_at if pending_at is not None else miss_at)
    finally:
        h.close()


@pytest.mark.parametrize("order", [["a", "a"], ["a", "b", "a"], ["a", "r", "b"], ["r", "a"], ["a", "b", "gone"],
                                   ["a", "b"]])
@LRUS
def test_complete_store_batches_equal_key_by_key(order, lru):
    """`complete_store`'s one-pass path makes blocks readable only when each was being written
    and given once; a batch with a key given twice, a readable key or an unknown key gets the
    key-by-key answer (each block written once made readable, stores counted once each)."""
    states = []
    for per_key in (False, True):
        h = memory_hierarchy(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy=lru)
        try:
            m = h.manager
            a, b, r, gone = UNIVERSE[:4]
            done = m.prepare_store([r], CTX)
            m.complete_store(done.keys_to_store, CTX)
            m.prepare_store([a, b], CTX)
            batch = [{"a": a, "b": b, "r": r, "gone": gone}[name] for name in order]
            if per_key:
                for k in batch:
                    m.complete_store([k], CTX)
            else:
                m.complete_store(batch, CTX)
            top = m.tiers[0]
            states.append(([(k, top.policy.get(k).ref_cnt) for k in (a, b, r)], sorted(top.table.pinned_keys()),
                           top.stats.stores))
        finally:
            h.close()
    assert states[0] == states[1]


@pytest.mark.parametrize("shared_at", [0, 1, 2])
@LRUS
def test_complete_load_of_blocks_also_pinned_by_a_copy(shared_at, lru):
    """A batch whose blocks were pinned once by the load, one of them also by a copy (a
    demotion): `complete_load` releases the load's pins only, as key by key (the block the copy
    holds stays pinned, the others become evictable), wherever that block is in the batch."""
    states = []
    for per_key in (False, True):
        h = memory_hierarchy(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy=lru)
        try:
            m = h.manager
            batch = UNIVERSE[:3]
            m.complete_store(m.prepare_store(batch, CTX).keys_to_store, CTX)
            m.prepare_load(batch, CTX)
            top = m.tiers[0]
            top.policy.get(batch[shared_at]).ref_cnt += 1  # what a demotion's pin does
            top.policy.evictable([batch[shared_at]], False)
            if per_key:
                for key in batch:
                    m.complete_load([key], CTX)
            else:
                m.complete_load(batch, CTX)
            states.append(([top.policy.get(k).ref_cnt for k in batch], sorted(top.table.pinned_keys())))
        finally:
            h.close()
    assert states[0] == states[1] and states[0][0] == [int(i == shared_at) for i in range(3)]


@pytest.mark.parametrize("writing_at", [0, 1, 2])
@pytest.mark.parametrize("loaded_at", [None, 0, 2])
@LRUS
def test_prepare_load_of_a_block_being_written_changes_nothing(writing_at, loaded_at, lru):
    """A batch with a block still being written (and maybe one pinned by an earlier load):
    `prepare_load` raises KeyError and leaves every block, pin and counter as it was."""
    h = memory_hierarchy(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy=lru)
    try:
        m = h.manager
        batch = list(UNIVERSE[:3])
        ready = [k for i, k in enumerate(batch) if i != writing_at]
        m.complete_store(m.prepare_store(ready, CTX).keys_to_store, CTX)
        m.prepare_store([batch[writing_at]], CTX)
        if loaded_at is not None and loaded_at != writing_at:
            m.prepare_load([batch[loaded_at]], CTX)
        before = state(m)
        with pytest.raises(KeyError):
            m.prepare_load(batch, CTX)
        assert state(m) == before
    finally:
        h.close()
