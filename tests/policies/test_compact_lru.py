"""`lru`'s compiled index (kvtier/policies/lru_compiled.py): built here, the same decisions as the
pure-Python `PureLRUCachePolicy` under any operation sequence (compiled and fallback), safe views, and
whole hierarchies on it (and on the fallback).

The conformance suite runs against both implementations in test_conformance.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks import cycle
from kvtier import LookupResult, build_hierarchy, load_config_text
from kvtier.bench import replay
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.core.types import BlockStatus, ReqContext
from kvtier.index import table_of
from kvtier.policies.lru_compiled import FallbackLRUCachePolicy, LRUCachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.testing.manager import ManagerTests
from tests.support.policy_state import evictable_count_of


def test_the_compiled_index_is_built():
    """This machine has a C compiler: a silent fallback here is a build bug."""
    try:
        import kvtier.policies._compact_lru  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"kvtier.policies._compact_lru is not built ({exc}): run `pip install -e .` (or "
                    "`python setup.py build_ext --inplace` in a checkout) with gcc and the Python headers "
                    "installed; lru falls back to pure Python (PureLRUCachePolicy's memory) without it")
    assert LRUCachePolicy.compiled and LRUCachePolicy.returns_views


def test_without_the_extension_the_name_resolves_to_the_fallback_and_says_so():
    code = """
import logging, sys
sys.modules["kvtier.policies._compact_lru"] = None  # as if it were not built
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from kvtier.transfer import registry
from kvtier.policies.lru_pure import PureLRUCachePolicy
cls = registry.resolve(registry.POLICIES, "lru")
a, b = cls(4), cls(4)
print("fallback", issubclass(cls, PureLRUCachePolicy), cls.compiled, a.returns_views)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "fallback True False False" in out
    assert out.count("pure-Python fallback") == 1, out  # once, not per policy built


def test_without_the_compiled_block_table_both_compiled_policies_fall_back():
    """The policies cimport the block table (kvtier/index/_table*.pyx): where it is missing they
    do not import, and both registered names resolve to their pure-Python fallbacks, which work."""
    code = """
import sys
sys.modules["kvtier.index._table"] = sys.modules["kvtier.index._table_api"] = None  # as if not built
from kvtier.transfer import registry
from kvtier.core.types import BlockStatus
for name in ("lru", "prefix-freq"):
    p = registry.resolve(registry.POLICIES, name)(4)
    p.insert(b"k", BlockStatus(3))
    print(name, type(p).compiled, p.get(b"k").block_id, len(p))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["lru False 3 1", "prefix-freq False 3 1"], out


def test_both_compiled_policies_compose_the_one_compiled_table():
    """`lru` and `prefix-freq` are each one table class composed with its order, not a table
    subclass: the table is the tier's block table; an order serves one table, and neither the
    order base nor an order already taken can make another."""
    from kvtier.index._table_api import BlockView, CompactOrder, CompactTable
    from kvtier.policies.prefix_compiled import PrefixFreqCachePolicy

    lru, pf = LRUCachePolicy(8), PrefixFreqCachePolicy(8)
    for policy in (lru, pf):
        assert not isinstance(policy, CompactTable) and type(policy.table) is CompactTable
        assert isinstance(policy.order, CompactOrder) and policy.table.order is policy.order
        table = table_of(policy)
        assert table is policy.table
        table.insert_written([b"a", b"b"], [5, 6])
        assert type(policy.get(b"a")) is BlockView and policy.get(b"b").ref_cnt == -1
        assert table.mark_written([b"a", b"b"]) and table.pin_loads([b"b", b"a"]) == [6, 5]
        assert table.pinned_keys() == {b"a", b"b"} and policy.victims(2) == []
        with pytest.raises(ValueError, match="already belongs to a table"):
            CompactTable(8, policy.order)
    with pytest.raises(TypeError, match="not made on its own"):
        CompactOrder()


# ---------------------------------------------------------------------- same decisions as lru
def key(i: int) -> bytes:
    """Keys of four lengths (the index re-lays its key array for a longer one; 68 bytes is past
    its inline width, a key with an allocation of its own)."""
    return i.to_bytes(4, "big") * (1 + i % 4 * 5) + b"\x00\x00\x00\x00"


def block(block_id: int, ref_cnt: int) -> BlockStatus:
    b = BlockStatus(block_id)
    b.ref_cnt = ref_cnt
    return b


def _state(p) -> tuple:
    return (len(p), sorted(p.keys()), p.victims(len(p)),
            [(k, p.get(k).block_id, p.get(k).ref_cnt) for k in p.victims(len(p))], evictable_count_of(p))


_OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 40), max_size=5), st.sampled_from([-1, 0, 0, 2])),
    st.tuples(st.just("remove"), st.integers(0, 40)),
    st.tuples(st.just("touch"), st.lists(st.integers(0, 40), max_size=6)),
    st.tuples(st.just("ref"), st.integers(0, 99), st.sampled_from([-1, 0, 0, 1, 2])),
    st.tuples(st.just("pin"), st.lists(st.integers(0, 99), max_size=3), st.booleans()),
    st.tuples(st.just("evict"), st.integers(0, 8), st.sets(st.integers(0, 40), max_size=4)),
    st.tuples(st.just("victims"), st.integers(-1, 12)),
    st.tuples(st.just("first_notice"),),
    st.tuples(st.just("clear"),),
), max_size=120)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, capacity=st.integers(1, 12), tracked=st.booleans())
def test_same_decisions_as_lru(ops, capacity, tracked):
    """`PureLRUCachePolicy`, the compiled `lru` and its fallback, driven alike: identical evictions, orders
    and counts after every step. `ref` changes a block's ref_cnt and reports pin/unpin honestly
    (as the manager does); `pin` reports them without a change (as a caller may, e.g. a copy
    that pins a block), so aside blocks, the freed heap and its duplicates are reached too. More
    blocks than the capacity are inserted at times (the index grows)."""
    policies = [PureLRUCachePolicy(capacity), LRUCachePolicy(capacity), FallbackLRUCachePolicy(capacity)]
    tracking = tracked  # as the manager runs them (the first notice at the start), or turned on later by an op
    for p in policies if tracked else ():
        p.evictable((), False)
    next_id = 0
    for op in ops:
        kind = op[0]
        resident = sorted(policies[0].keys())
        if kind == "insert":
            keys = list(dict.fromkeys(key(i) for i in op[1] if policies[0].get(key(i)) is None))
            blocks = [block(next_id + j, op[2]) for j in range(len(keys))]
            next_id += len(keys)
            for p in policies:
                p.insert_many(keys, blocks) if len(keys) > 1 else [p.insert(k, b) for k, b in zip(keys, blocks)]
                if tracking and op[2] != 0:
                    p.evictable(keys, False)
        elif kind == "remove":
            for p in policies:
                p.remove(key(op[1]))
        elif kind == "touch":
            for p in policies:
                p.touch([key(i) for i in op[1]])
        elif kind == "ref" and resident:
            k = resident[op[1] % len(resident)]
            old = policies[0].get(k).ref_cnt
            for p in policies:
                p.get(k).ref_cnt = op[2]
                if old == 0 and op[2] != 0:
                    p.evictable([k], False)
                elif old != 0 and op[2] == 0:
                    p.evictable([k], True)
        elif kind == "pin" and resident:
            keys = [resident[i % len(resident)] for i in op[1]]
            for p in policies:
                p.evictable(keys, not op[2])
        elif kind == "evict":
            protected = {resident[i % len(resident)] if resident and i < 30 else key(i) for i in op[2]}
            got = [p.evict(op[1], protected) for p in policies]
            values = [None if v is None else [(k, b.block_id, b.ref_cnt) for k, b in v] for v in got]
            assert values[1] == values[0] and values[2] == values[0]
        elif kind == "victims":
            assert policies[1].victims(op[1]) == policies[0].victims(op[1]) == policies[2].victims(op[1])
        elif kind == "first_notice":
            tracking = True
            for p in policies:
                p.evictable((), False)
        elif kind == "clear":
            for p in policies:
                p.clear()
        state = _state(policies[0])
        assert _state(policies[1]) == state and _state(policies[2]) == state
        assert evictable_count_of(policies[1]) == evictable_count_of(policies[0]) == evictable_count_of(policies[2])


@pytest.mark.parametrize("cls", [PureLRUCachePolicy, LRUCachePolicy])
def test_an_aside_block_unpinned_twice_is_evicted_once(cls):
    """An unpin of a block set aside (pinned at the head of the order) queues it for eviction
    again each time; the duplicates must not make one block two victims."""
    p = cls(8)
    p.evictable((), False)
    p.insert_many([key(1), key(2), key(3)], [block(1, 0), block(2, 0), block(3, 0)])
    p.get(key(1)).ref_cnt = 1
    p.evictable([key(1)], False)
    assert [k for k, _ in p.evict(1, set())] == [key(2)]  # key(1) met at the head: set aside
    p.get(key(1)).ref_cnt = 0
    p.evictable([key(1), key(1)], True)
    p.evictable([key(1)], True)
    assert [k for k, _ in p.evict(2, set())] == [key(1), key(3)]
    assert len(p) == 0 and p.evict(1, set()) is None


def test_grows_beyond_its_capacity_and_keeps_every_block():
    p = LRUCachePolicy(3)
    blocks = [block(i, 0) for i in range(1000)]
    p.insert_many([key(i) for i in range(1000)], blocks)
    assert len(p) == 1000 and all(p.get(key(i)).block_id == i for i in range(1000))
    assert [k for k, _ in p.evict(3, {key(1)})] == [key(0), key(2), key(3)]
    assert p.get(key(1000)) is None


def test_a_view_of_a_block_that_left_raises_instead_of_touching_another():
    p = LRUCachePolicy(4)
    p.insert(key(1), block(7, 0))
    view = p.get(key(1))
    p.remove(key(1))
    p.insert(key(1), block(8, 0))  # the same key, a new slot: most likely the same entry
    with pytest.raises(LookupError, match="no longer resident"):
        view.ref_cnt = 3
    assert p.get(key(1)).ref_cnt == 0 and view.block_id == 7


def test_a_view_kept_across_clear_raises():
    """`clear` left the entries marked used: a view of a block beyond the entries used again
    afterwards still read and wrote its old entry."""
    p = LRUCachePolicy(8)
    p.insert_many([key(1), key(2), key(3)], [block(1, 0), block(2, 0), block(3, 0)])
    view = p.get(key(3))
    p.clear()
    p.insert(key(1), block(9, 0))
    with pytest.raises(LookupError, match="no longer resident"):
        view.ref_cnt = 5
    assert p.get(key(1)).ref_cnt == 0 and p.get(key(3)) is None


def test_bad_keys_are_reported():
    p = LRUCachePolicy(4)
    with pytest.raises(TypeError, match="must be bytes"):
        p.insert("abc", block(1, 0))
    with pytest.raises(ValueError, match="at most 65535 bytes"):
        p.insert(b"x" * 65536, block(1, 0))
    with pytest.raises(ValueError, match="cache_capacity must be > 0"):
        LRUCachePolicy(0)


# ---------------------------------------------------------------------- whole hierarchies on it
class _Hierarchy(ManagerTests):
    yaml = ""
    policy = "lru"  # the registered name: the compiled index here

    def make_manager(self, tmp_path):
        text = self.yaml.replace("{root}", str(tmp_path / "nvme")).replace("{policy}", self.policy)
        self.hierarchy = build_hierarchy(load_config_text(text), enable_events=True, model="conformance")
        return self.hierarchy.manager

    def capacities(self, manager):
        return {tier.name: tier.capacity for tier in manager.tiers}


FALLBACK = "kvtier.policies.lru_compiled:FallbackLRUCachePolicy"  # what `lru` resolves to when not built


def _memory_yaml(cascade: str) -> str:
    return f"""
block_bytes: 64B
tiers:
  - {{name: hot, backend: memory, capacity: 6 blocks, policy: {{policy}}, cascade: {cascade}, reserve: 0.34}}
  - {{name: warm, backend: memory, capacity: 14 blocks, policy: {{policy}}}}
"""


class TestSingleTier(_Hierarchy):
    yaml = """
block_bytes: 64B
tiers:
  - {name: hot, backend: memory, capacity: 8 blocks, policy: {policy}}
"""


class TestMemoryOnEvict(_Hierarchy):
    yaml = _memory_yaml("on_evict")


class TestMemoryOnStore(_Hierarchy):
    yaml = _memory_yaml("on_store")


class TestCPUFile(_Hierarchy):
    """Demotions into and promotions out of a file tier whose blocks are views."""

    yaml = """
block_bytes: 4KiB
tiers:
  - {name: cpu, backend: cpu, capacity: 6 blocks, policy: {policy}, cascade: on_evict, reserve: 0.34, pin: false}
  - {name: nvme, backend: file, root_dir: "{root}", capacity: 14 blocks, policy: {policy}, io: posix}
"""


class TestSingleTierFallback(TestSingleTier):
    policy = FALLBACK


class TestMemoryOnEvictFallback(TestMemoryOnEvict):
    policy = FALLBACK


class TestMemoryOnStoreFallback(TestMemoryOnStore):
    policy = FALLBACK


class TestCPUFileFallback(TestCPUFile):
    policy = FALLBACK


def test_a_failed_promotion_drops_the_lower_copy_held_as_a_view():
    """`Promotion.failed` drops a source block that could not be read if it is still the same
    block: with views it is compared by block_id (an identity test never matched a view)."""
    yaml = _memory_yaml("on_evict").replace("6 blocks", "2 blocks").replace("{policy}", "lru")
    h = build_hierarchy(load_config_text(yaml))
    m, ctx = h.manager, ReqContext("r")
    ks = [bytes([i]) * 8 + b"\0\0\0\0" for i in range(4)]
    for part in (ks[:2], ks[2:]):
        out = m.prepare_store(part, ctx)
        assert out is not None
        m.complete_store(out.keys_to_store, ctx)
    assert m.tiers[0].policy.get(ks[0]) is None and m.tiers[1].policy.get(ks[0]) is not None
    handler = h.router.handler_for(CPULoadStoreSpec, CPULoadStoreSpec)
    handler.copy = lambda src, dst: (_ for _ in ()).throw(OSError(5, "injected EIO"))
    assert m.lookup(ks[0], ctx) is LookupResult.RETRY
    m.on_schedule_end()
    assert m.lookup(ks[0], ctx) is LookupResult.MISS
    assert m.tiers[1].policy.get(ks[0]) is None
    h.close()


@pytest.mark.parametrize("workload", ["agentic", "scan"])
@pytest.mark.parametrize("multi", [False, True], ids=["one-tier", "cpu+file"])
def test_replay_hit_rates_equal_lrus(workload, multi):
    """The cycle benchmark's generated workloads (small capacity: many evictions, demotions and
    promotions): every figure of the replay but time equals the pure-Python PureLRUCachePolicy's."""
    from dataclasses import replace

    trace = cycle.load_workload(workload, cycle.DEFAULT_TRACES)
    compiled = cycle.config_for("lru+file" if multi else "lru", 300)
    pure = replace(compiled, tiers=tuple(replace(t, policy="kvtier.policies.lru_pure:PureLRUCachePolicy")
                                         for t in compiled.tiers))
    results = [replay.replay_kvtier(config, trace) for config in (pure, compiled)]
    for r in results:
        for row in r["tiers"].values():
            del row["policy"]
    keep = ("hit_rate", "hit_blocks", "stores_refused", "retry_steps", "tiers")
    lru, compact = ({k: r[k] for k in keep} for r in results)
    assert compact == lru
    assert lru["hit_blocks"] > 0
