"""`prefix-freq`'s compiled index (kvtier/policies/prefix_compiled.py) as a system part: built here,
the registered name's fallback without it, and whole hierarchies replaying workloads with exactly
the decisions of the pure-Python `PurePrefixFreqCachePolicy` (every figure, and the policy's state
at the end: ghosts, clock, hit-age mean, tail evidence). The operation-level differential tests
are in test_compact_prefix.py; the conformance suites run on both in test_conformance.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from benchmarks import cycle
from kvtier.bench import replay, workloads
from kvtier.control.hierarchy import build_hierarchy
from kvtier.core.types import BlockStatus
from kvtier.policies.prefix_compiled import PrefixFreqCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.policies.prefix_tails import TailEvidence
from tests.support.policy_state import pinned_of

PURE = "kvtier.policies.prefix_pure:PurePrefixFreqCachePolicy"


def test_the_compiled_index_is_built():
    """This machine has a C compiler: a silent fallback here is a build bug."""
    try:
        import kvtier.policies._compact_prefix  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"kvtier.policies._compact_prefix is not built ({exc}): run `pip install -e .` (or "
                    "`python setup.py build_ext --inplace` in a checkout) with gcc and the Python headers "
                    "installed; prefix-freq falls back to pure Python without it")
    assert PrefixFreqCachePolicy.compiled and PrefixFreqCachePolicy.returns_views
    assert PrefixFreqCachePolicy.batch_calls


def test_without_the_extension_the_name_resolves_to_the_fallback_and_says_so():
    code = """
import logging, sys
sys.modules["kvtier.policies._compact_prefix"] = None  # as if it were not built
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from kvtier.transfer import registry
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.policies.prefix_tails import TailEvidence
cls = registry.resolve(registry.POLICIES, "prefix-freq")
a, b = cls(4), cls(4)
print("fallback", issubclass(cls, PurePrefixFreqCachePolicy), cls.compiled, a.returns_views, a.batch_calls)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "fallback True False False False" in out
    assert out.count("pure-Python fallback") == 1, out  # once, not per policy built


def readable(block_ids) -> list[BlockStatus]:
    blocks = BlockStatus.many(block_ids)
    for block in blocks:
        block.ref_cnt = 0
    return blocks


def test_grows_beyond_its_capacity_and_keeps_every_block():
    p = PrefixFreqCachePolicy(3)
    keys = [i.to_bytes(4, "big") * (1 + i % 4) for i in range(1000)]  # the key array re-laid as keys grow
    p.insert_many(keys, readable(range(1000)))
    assert len(p) == 1000 and all(p.get(k).block_id == i for i, k in enumerate(keys))
    assert [k for k, _ in p.evict(3, {keys[1]})] == [keys[0], keys[2], keys[3]]
    assert p.get(b"absent") is None


def test_bad_keys_and_capacities_are_reported():
    p = PrefixFreqCachePolicy(4)
    with pytest.raises(TypeError, match="must be bytes"):
        p.insert("abc", BlockStatus(1))
    with pytest.raises(ValueError, match="at most 65535 bytes"):
        p.insert(b"x" * 65536, BlockStatus(1))
    with pytest.raises(ValueError, match="cache_capacity must be > 0"):
        PrefixFreqCachePolicy(0)


def policy_state(policy) -> tuple:
    """What the two implementations must agree on after a replay (their inspection properties)."""
    return (sorted((k, policy.get(k).block_id, policy.get(k).ref_cnt) for k in policy.keys()),
            policy.victims(len(policy)), list(policy.ghosts.items()), policy.clock, policy.unit,
            policy.tail_counts,
            sorted(pinned_of(policy) or ()))


def replayed(config, trace) -> tuple[dict, tuple, bool]:
    """Replay `trace` through a dry-run hierarchy; (its figures, tier 0's policy state, whether
    request tails were one-time at the end)."""
    hierarchy = build_hierarchy(config, dry_run=True)
    try:
        result = replay.replay_manager(hierarchy.manager, trace)
        stats = hierarchy.manager.get_stats()
        policy = hierarchy.manager.tiers[0].policy
        evidence = TailEvidence()
        evidence.counts = policy.tail_counts
        one_time = evidence.one_time(PurePrefixFreqCachePolicy.tail_reuse_max)
        return ({k: result[k] for k in ("hit_rate", "hit_blocks", "stores_refused", "retry_steps")} | {"tiers": stats},
                policy_state(policy), one_time)
    finally:
        hierarchy.close()


@pytest.mark.parametrize("workload", ["agentic", "scan", "conversations"])
@pytest.mark.parametrize("multi", [False, True], ids=["one-tier", "cpu+file"])
def test_replay_equals_the_pure_policy(workload, multi):
    """Generated workloads at a small capacity (many evictions, aside blocks, demotions and
    promotions): every figure of the replay and tier 0's final state equal the pure class's."""
    if workload == "conversations":  # each request ends in a partial block of its own (the Mooncake traces' tails)
        turns = workloads.generate_trace().requests
        trace = workloads.Trace("partial-tails", [r + [(1 << 62) + i] for i, r in enumerate(turns)])
    else:
        trace = cycle.load_workload(workload, "")
    compiled = cycle.config_for("prefix-freq+file" if multi else "prefix-freq", 200)
    pure = replace(compiled, tiers=(replace(compiled.tiers[0], policy=PURE), *compiled.tiers[1:]))
    (figures, state, one_time), (pure_figures, pure_state, _) = replayed(compiled, trace), replayed(pure, trace)
    assert figures == pure_figures
    assert state == pure_state
    assert figures["hit_blocks"] > 0 and state[2], "the replay evicted nothing"
    if workload == "conversations":
        assert one_time, "the tail rule never switched on: the replay does not test it"


COUNTS = [[0] * 6, [64, 0, 64, 0, 0, 0], [100, 1, 100, 30, 5, 90], [100, 9, 50, 5, 1, 60],
          [3_000_000_000, 1, 3_000_000_000, 2_000_000_000, 5, 2_900_000_000],
          [2**40, 2**38, 2**41, 2**35, 2**37, 2**42], [2**62, 0, 2**62, 2**61, 2**60, 2**62 + 5],
          # a product past int64: wrapped around, it would have said one-time
          [23_012_293_790, 303_136_405, 787_103_486_489, 17_569_897_831, 991_255_390, 71_045_694_426]]


@pytest.mark.parametrize("counts", COUNTS, ids=range(len(COUNTS)))
def test_the_tail_rule_equals_pythons_exact_comparison_at_any_count(counts):
    """The compiled rule compares in C while counts are small and in Python beyond, so counts past
    int64 products (a long-running scheduler) decide as the pure class decides. Observed through
    the eviction order: an older new block goes first unless tails are one-time."""
    expected = TailEvidence()
    expected.counts = list(counts)
    one_time = expected.one_time(PurePrefixFreqCachePolicy.tail_reuse_max)
    orders = []
    for cls in (PurePrefixFreqCachePolicy, PrefixFreqCachePolicy):
        p = cls(8)
        p.insert(b"older", readable([1])[0])
        p.touch([b"absent"])  # the clock moves on
        p.insert_many([b"tail"], readable([2]), tail=b"tail")
        p.touch([b"absent"])
        p.tail_counts = counts
        orders.append(p.victims(2))
    assert orders[0] == orders[1] == ([b"tail", b"older"] if one_time else [b"older", b"tail"])


def test_the_package_ships_what_builds_the_compiled_indexes():
    """An sdist must carry every Cython source the extensions read (setuptools adds only the
    `.pyx` it is given): the `.pxd` declarations they `cimport` (the block table in kvtier/index,
    prefix-freq's order and ghosts) as well, or a build from it silently falls back to pure Python."""
    import fnmatch
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvtier"]
    sources = [p.relative_to(root / "kvtier").as_posix() for ext in ("pyx", "pxd", "pxi", "pyi")
               for package in ("index", "policies") for p in (root / "kvtier" / package).glob(f"*.{ext}")]
    assert {"index/_table.pxd", "index/_table_api.pxd", "policies/_compact_prefix_order.pxd"} <= set(sources)
    assert len(sources) >= 12
    assert [s for s in sources if not any(fnmatch.fnmatch(s, pattern) for pattern in patterns)] == []


@pytest.mark.parametrize("limit", [None, 0, 1, 37])
def test_the_compiled_ghost_list_keeps_the_pure_ones_order_through_compactions(limit):
    """Thousands of evictions and returns with keys that grow longer as the run goes (the ghost
    array is re-laid for them) and ghost limits that trim often or never: the ghosts, oldest
    first, and every placement they decide equal the pure class's after each request."""
    import random

    rng = random.Random(limit)
    pure, compiled = PurePrefixFreqCachePolicy(40), PrefixFreqCachePolicy(40)
    if limit is not None:
        pure.ghost_limit = compiled.ghost_limit = limit
    for step in range(3000):
        width = 4 + step // 300  # 4..13 bytes, longer every 300 requests
        keys = list(dict.fromkeys(rng.randrange(400).to_bytes(2, "big") * width for _ in range(rng.randint(1, 6))))
        keys = [k for k in keys if pure.get(k) is None]
        over = len(pure) + len(keys) - 40
        if over > 0:
            assert [k for k, _ in pure.evict(over, set())] == [k for k, _ in compiled.evict(over, set())]
        for p in (pure, compiled):
            p.insert_many(keys, readable(range(len(keys))), tail=keys[0] if keys else None)
            p.touch(keys[1:2])
        assert list(compiled.ghosts.items()) == list(pure.ghosts.items()), step
    assert compiled.tail_counts == pure.tail_counts and compiled.unit == pure.unit
    if limit is None or limit > 1:
        assert pure.tail_counts[1] + pure.tail_counts[3] > 0, "no ghost ever returned"
