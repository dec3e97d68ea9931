"""One set of limits (issue 27.3, kvtier/core/limits.py): `config check` and the build refuse the same
capacities, each as a `ConfigError` on the tier's `capacity`, and a capacity a tier can hold
builds without allocating for it up front."""

from __future__ import annotations

import pytest

from kvtier import ConfigError, build_hierarchy, load_config_text
from kvtier.cli.main import main
from kvtier.config import MAX_BLOCKS, MAX_BYTES
from kvtier.core import limits
from kvtier.core.types import BlockStatus
from kvtier.policies.lru_compiled import LRUCachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.policies.prefix_compiled import PrefixFreqCachePolicy
from kvtier.tiers.remote.backend import ValkeyBackend

LIMIT = limits.MAX_INDEX_BLOCKS


def valkey_config(blocks: int | str, policy: str = "") -> str:
    """A memory tier and a valkey tier of `blocks` handles (nothing connects until it is used)."""
    return ("tiers:\n  - {name: cpu, backend: memory, capacity: 100 blocks}\n"
            f"  - {{name: shared, backend: valkey, capacity: {blocks} blocks, url: 'redis://127.0.0.1:1',"
            f" key_prefix: 'kvt:t'{', policy: ' + policy if policy else ''}}}\n")


def memory_config(capacity: str, policy: str = "lru") -> str:
    return f"tiers:\n  - {{name: one, backend: memory, capacity: {capacity}, policy: {policy}}}\n"


def problems(text: str, **build) -> list[tuple[str, str]]:
    """What `config check` (no code imported) and, when it passes, the build find wrong."""
    try:
        config = load_config_text(text, import_code=False)
    except ConfigError as exc:
        return exc.problems
    try:
        hierarchy = build_hierarchy(load_config_text(text), model="m", **build)
    except ConfigError as exc:
        return exc.problems
    hierarchy.close()
    assert config.tiers
    return []


def test_the_limits_are_stated_once():
    assert (MAX_BLOCKS, MAX_BYTES) == (limits.MAX_BLOCKS, limits.MAX_BYTES)
    for cls in (LRUCachePolicy, PrefixFreqCachePolicy):
        assert cls.max_blocks == LIMIT
        cls(LIMIT)  # what the index itself accepts (test_compact_keys.py: one more is refused)
    assert PureLRUCachePolicy.max_blocks is None and ValkeyBackend.max_blocks is None


@pytest.mark.parametrize("cls", [LRUCachePolicy, PrefixFreqCachePolicy], ids=lambda c: c.__name__)
def test_a_compiled_index_holds_keys_up_to_the_length_it_states(cls):
    policy = cls(4)
    longest = b"k" * limits.MAX_KEY_BYTES
    assert cls.max_key_bytes == limits.MAX_KEY_BYTES and PureLRUCachePolicy.max_key_bytes is None
    policy.insert(longest, BlockStatus(1))
    assert policy.get(longest).block_id == 1
    with pytest.raises(ValueError, match=f"at most {limits.MAX_KEY_BYTES} bytes"):
        policy.insert(longest + b"k", BlockStatus(2))


def test_config_check_refuses_handles_past_the_index_of_the_valkey_tier(tmp_path, capsys):
    """2,000,000,000 handles passed `config check`, then the build failed with a ValueError of the
    policy (not a ConfigError on the field)."""
    path = tmp_path / "c.yaml"
    path.write_text(valkey_config(2_000_000_000))
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert ("tiers[1].capacity: 2000000000 blocks is more than policy 'lru' can hold (at most 1073741824 blocks)"
            in err), err


def test_a_valkey_tier_of_the_most_handles_builds_without_allocating_for_them():
    """2^30 handles raised MemoryError at build (the index was allocated up front)."""
    hierarchy = build_hierarchy(load_config_text(valkey_config(LIMIT)), block_bytes=4096, model="m")
    try:
        tier = hierarchy.manager.tiers[1]
        assert tier.backend.num_blocks == LIMIT
        assert tier.policy.memory_bytes() < 1 << 20
    finally:
        hierarchy.close()


def test_a_policy_without_an_index_limit_takes_more_handles():
    assert problems(valkey_config(2_000_000_000, policy="arc"), block_bytes=4096) == []
    assert problems(valkey_config(MAX_BLOCKS + 1, policy="arc"))[0][0] == "tiers[1].capacity"


@pytest.mark.parametrize(("text", "build"), [
    (memory_config(f"{LIMIT + 1} blocks"), {"dry_run": True}),
    (memory_config(f"{LIMIT + 1} blocks", "prefix-freq"), {"dry_run": True}),
    # a size: counted in blocks by config check only when the config gives block_bytes
    (memory_config("8TiB"), {"dry_run": True, "block_bytes": 4096}),
    ("block_bytes: 4KiB\n" + memory_config("8TiB"), {"dry_run": True}),
], ids=["lru", "prefix-freq", "size-at-build", "size-in-config"])
def test_config_check_and_the_build_refuse_alike(text, build):
    """Past the compiled index's limit: the same ConfigError on tiers[0].capacity from whichever
    sees the count first (the dry-run build of `kvtier bench trace` raised a ValueError)."""
    found = problems(text, **build)
    assert len(found) == 1 and found[0][0] == "tiers[0].capacity", found
    assert "more than policy" in found[0][1] and "at most 1073741824 blocks" in found[0][1], found


def test_the_build_checks_a_count_config_check_could_not_know():
    text = memory_config("8TiB")
    load_config_text(text, import_code=False)  # a size without block_bytes: not counted here
    with pytest.raises(ConfigError) as info:
        build_hierarchy(load_config_text(text), block_bytes=4096, dry_run=True, model="m")
    assert info.value.problems[0][0] == "tiers[0].capacity"


def test_tier_blocks_problem_names_what_sets_the_limit():
    assert limits.tier_blocks_problem(LIMIT, ValkeyBackend, LRUCachePolicy) is None
    message = limits.tier_blocks_problem(LIMIT + 1, ValkeyBackend, LRUCachePolicy, policy_name="lru")
    assert message is not None and "policy 'lru'" in message and "choose a policy" in message
    assert limits.tier_block_limit(None, None) == (MAX_BLOCKS, "any tier")
    assert "at least 1 block" in (limits.tier_blocks_problem(0) or "")
