"""A tier's `policy:` class that cannot be built or driven by kvtier is a `ConfigError` naming
`tiers[i].policy` (at the build, and with `config check --import-code` where it can be told without
building), not a bare TypeError or a tier that never evicts; `PolicyTests` fails, rather than hangs,
on a policy whose evict never refuses; `policy: LRU` is told "did you mean 'lru'?"."""

from __future__ import annotations

import threading

import pytest

from kvtier import ConfigError, build_hierarchy, load_config_text
from kvtier.cli.main import main
from kvtier.core.quoting import suggest
from kvtier.testing import PolicyTests
from kvtier.testing.policy_contract import EVICT_REFUSED
from kvtier.testing.policy_contract import UNPINNED as UNPINNED_CLAUSE
from tests.support import policy_classes

HERE = "tests.support.policy_classes"


def config_text(policy: str) -> str:
    return ("block_bytes: 64B\ntiers:\n"
            f"  - {{name: hot, backend: memory, capacity: 8 blocks, policy: \"{policy}\"}}\n"
            "  - {name: warm, backend: memory, capacity: 16 blocks, policy: lru}\n")


def build_problems(policy: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        build_hierarchy(load_config_text(config_text(policy))).close()
    return info.value.problems


def check_output(tmp_path, capsys, policy: str) -> tuple[int, str]:
    path = tmp_path / "c.yaml"
    path.write_text(config_text(policy))
    code = main(["config", "check", "--import-code", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(("name", "words"), [
    ("Abstract", "Abstract is abstract: it does not implement evict"),
    ("TakesNoCapacity", "TakesNoCapacity cannot be built as TakesNoCapacity(capacity): its signature is ()"),
])
def test_a_class_that_cannot_be_built_fails_config_check_and_the_build(tmp_path, capsys, name, words):
    """Before: `config check --import-code` passed; the build raised a bare TypeError."""
    code, out = check_output(tmp_path, capsys, f"{HERE}:{name}")
    assert code == 2 and f"tiers[0].policy: policy '{HERE}:{name}': {words}" in out, out
    [(field, message)] = build_problems(f"{HERE}:{name}")
    assert field == "tiers[0].policy" and words in message


def test_an_init_that_raises_is_a_config_error_naming_the_tier():
    """Before: the class's own RuntimeError, with no tier or field."""
    [(field, message)] = build_problems(f"{HERE}:RaisesInInit")
    assert field == "tiers[0].policy"
    assert "RaisesInInit(8) raised RuntimeError: boom in __init__" in message


def test_a_vllm_shaped_policy_is_refused_without_vllm(tmp_path, capsys):
    """Before: accepted, and the tier never evicted (kvtier never calls mark_evictable)."""
    [(field, message)] = build_problems(f"{HERE}:VllmShaped")
    assert field == "tiers[0].policy" and "vLLM's CachePolicy classes use a different contract" in message
    assert "would never evict; use kvtier's 'lru' or 'arc'" in message
    code, out = check_output(tmp_path, capsys, f"{HERE}:VllmShaped")
    assert code == 2 and "different contract" in out


@pytest.mark.parametrize(("name", "builtin"), [("lru:LRUCachePolicy", "lru"), ("arc:ARCCachePolicy", "arc")])
def test_vllm_own_policies_are_refused_naming_the_builtin(name, builtin):
    pytest.importorskip("vllm.v1.kv_offload.cpu.policies.base")
    [(field, message)] = build_problems(f"vllm.v1.kv_offload.cpu.policies.{name}")
    assert field == "tiers[0].policy" and "different contract" in message
    assert f"would never evict; use kvtier's built-in {builtin!r}, which makes the same choices" in message


def test_policy_name_typo_in_case_gets_a_suggestion():
    """Before: `policy: LRU` got no "did you mean"."""
    assert suggest("LRU", ["lru", "arc"]) == " (did you mean 'lru'?)"
    [(field, message)] = build_problems("LRU")
    assert field == "tiers[0].policy" and "(did you mean 'lru'?)" in message


class NeverRefusesTests(PolicyTests):
    policy_factory = policy_classes.NeverRefuses


def test_policy_tests_fail_rather_than_hang_on_an_evict_that_never_refuses():
    """Before: `test_victims_is_the_evict_order_one_at_a_time` looped for ever (here, until the
    policy's own guard stopped it)."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            NeverRefusesTests().test_victims_is_the_evict_order_one_at_a_time()
        except BaseException as exc:  # pytest's Failed is a BaseException
            outcome.append(exc)

    policy_classes.NeverRefuses.calls = 0
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "PolicyTests did not return within 60 s"
    assert outcome, "PolicyTests passed a policy whose evict never refuses"
    assert not isinstance(outcome[0], policy_classes.StillCalled), "PolicyTests kept calling evict"
    assert EVICT_REFUSED in str(outcome[0])
    assert policy_classes.NeverRefuses.calls <= 9


class NoticeForgetsSuite(PolicyTests):
    policy_factory = policy_classes.NoticeForgets
    __test__ = False  # (run below, expecting failures: not collected on its own)


def test_policy_tests_send_the_notices_the_block_table_sends():
    """The manager tells a policy of every block that stops or starts being evictable; a policy
    that mishandles those notices wedges its tier (no eviction once blocks were unpinned). Before,
    the suite changed `ref_cnt` without a notice and passed such a policy."""
    with pytest.raises(AssertionError, match=UNPINNED_CLAUSE):
        NoticeForgetsSuite().test_pinned_blocks_become_evictable_when_unpinned()
