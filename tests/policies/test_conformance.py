"""`kvtier.testing.policy.PolicyTests` run for every policy in `kvtier.transfer.registry.POLICIES` and for
policies written to vLLM's seed contract; broken policies are shown to fail it.

A policy added to the registry needs one `Test...(PolicyTests)` class here: the coverage test below
derives the policies from the registry and fails naming one no class here runs the suite on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from seed_policy import DuckSeedPolicy, SeedLRUPolicy

from kvtier.policies.base import CachePolicy, KeyIndex, with_key_index
from kvtier.policies.lru_compiled import FallbackLRUCachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.policies.prefix_compiled import FallbackPrefixFreqCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.testing.policy import PolicyTests, fill, key
from kvtier.transfer import registry


def registered(name: str):
    return registry.resolve(registry.POLICIES, name)


class TestLRU(PolicyTests):
    """The compiled index (tests/policies/test_compact_lru.py fails where it is not built)."""

    policy_factory = registered("lru")


class TestLRUFallback(PolicyTests):
    """`lru`'s pure-Python fallback, what the name resolves to without the extension."""

    policy_factory = FallbackLRUCachePolicy


class TestPurePythonLRU(PolicyTests):
    policy_factory = PureLRUCachePolicy


class TestARC(PolicyTests):
    policy_factory = registered("arc")


class TestSIEVE(PolicyTests):
    policy_factory = registered("sieve")


class TestPrefixFreq(PolicyTests):
    """The compiled index (tests/policies/test_compact_prefix.py fails where it is not built)."""

    policy_factory = registered("prefix-freq")


class TestPrefixFreqFallback(PolicyTests):
    """`prefix-freq`'s pure-Python fallback, what the name resolves to without the extension."""

    policy_factory = FallbackPrefixFreqCachePolicy


class TestPurePythonPrefixFreq(PolicyTests):
    policy_factory = PurePrefixFreqCachePolicy


class TestSeedContractPolicy(PolicyTests):
    """Only the seed's methods; `keys`/`len`/`clear` come from `KeyIndex`."""

    policy_factory = SeedLRUPolicy
    predicts_victims = False


class TestDuckTypedSeedPolicy(PolicyTests):
    policy_factory = DuckSeedPolicy
    predicts_victims = False

    def test_capacity_must_be_positive(self):
        pytest.skip("the seed contract does not ask a policy to validate its capacity")


def policy_suites(namespace: Mapping[str, Any]) -> dict[str, type]:
    """The conformance classes of a test module (its globals): `Test...` subclasses of PolicyTests."""
    return {name: obj for name, obj in namespace.items()
            if name.startswith("Test") and isinstance(obj, type) and issubclass(obj, PolicyTests)}


def policy_tested(suite_cls: type) -> Any:
    """What `suite_cls` runs the suite on: its `policy_factory`, or else the class of the policy its
    `make_policy` builds (the policy inside `with_key_index`'s wrapper)."""
    if suite_cls.policy_factory is not None:
        return suite_cls.policy_factory
    policy = suite_cls().make_policy(8)
    return type(policy.policy if isinstance(policy, KeyIndex) else policy)


def policies_without_a_suite(registered: Mapping[str, str], suites: Iterable[type]) -> list[str]:
    """The names of `registered` (name -> "module:Class", as `registry.POLICIES`) no suite tests."""
    tested = {policy_tested(cls) for cls in suites}
    return sorted(name for name in registered if registry.resolve(registered, name) not in tested)


def test_every_registered_policy_runs_the_suite():
    """Every policy in `registry.POLICIES`, whatever they are, has a PolicyTests class here."""
    assert registry.POLICIES, "no policy is registered"
    missing = policies_without_a_suite(registry.POLICIES, policy_suites(globals()).values())
    assert missing == [], (f"registered policies no PolicyTests class in {__name__} runs the suite on: {missing}; "
                           "add a `class Test...(PolicyTests)` here with policy_factory = registered(name)")


# ---------------------------------------------------------------- seed contract
def test_only_the_seed_methods_are_abstract():
    assert CachePolicy.__abstractmethods__ == {"get", "insert", "remove", "touch", "evict"}


def test_with_key_index_keeps_full_policies_and_completes_seed_ones():
    lru = PureLRUCachePolicy(4)
    assert with_key_index(lru) is lru
    for seed in (SeedLRUPolicy(4), DuckSeedPolicy(4)):
        wrapped = with_key_index(seed)
        assert isinstance(wrapped, KeyIndex) and wrapped.policy is seed
        blocks = fill(wrapped, range(3))
        assert seed.get(key(1)) is blocks[key(1)]  # decisions and blocks stay the seed policy's
        assert sorted(wrapped.keys()) == sorted(blocks) and len(wrapped) == 3


def test_unwrapped_seed_policy_says_how_to_get_keys():
    with pytest.raises(NotImplementedError, match="with_key_index"):
        SeedLRUPolicy(4).keys()


def test_default_len_and_clear_go_through_keys():
    class Listed(SeedLRUPolicy):
        def keys(self):
            return list(self.blocks)

    policy = Listed(8)
    assert with_key_index(policy) is policy
    fill(policy, range(5))
    assert len(policy) == 5
    policy.clear()
    assert len(policy) == 0 and policy.get(key(0)) is None


# ---------------------------------------------------------------- the suite catches broken policies
class EvictsPinned(PureLRUCachePolicy):
    """Broken: takes the least recently used blocks whether pinned or not."""

    def evict(self, n, protected):
        chosen = [(k, self.get(k)) for k, _ in zip(list(self.keys()), range(n))]
        if len(chosen) < n:
            return None
        for k, _ in chosen:
            self.remove(k)
        return chosen


class LeaksStateOnRefusedEvict(PureLRUCachePolicy):
    """Broken: a refused eviction still reorders the blocks it looked at."""

    def evict(self, n, protected):
        victims = super().evict(n, protected)
        if victims is None:
            self.touch(sorted(self.keys())[:1])
        return victims


def _fails_within(check, runs: int = 5) -> bool:
    """Whether `check` raises AssertionError in one of `runs` runs. The suite's random-operations
    check draws new examples on every run (not derandomized: coverage grows across runs), so a
    single run may miss a defect that another finds; the deterministic checks fail on the first."""
    for _ in range(runs):
        try:
            check()
        except AssertionError:
            return True
    return False


class BrokenPinSuite(PolicyTests):
    policy_factory = EvictsPinned


class BrokenAtomicitySuite(PolicyTests):
    policy_factory = LeaksStateOnRefusedEvict


@pytest.mark.parametrize("check", ["test_pinned_and_protected_never_evicted", "test_random_operations_against_model"])
def test_suite_fails_a_policy_that_evicts_pinned_blocks(check):
    assert _fails_within(getattr(BrokenPinSuite(), check)), f"{check} passed a policy that evicts pinned blocks"


@pytest.mark.parametrize("check", ["test_evict_too_many_returns_none_without_change",
                                   "test_random_operations_against_model"])
def test_suite_fails_a_policy_that_changes_state_on_a_refused_evict(check):
    assert _fails_within(getattr(BrokenAtomicitySuite(), check)), f"{check} passed a policy that leaks state"
