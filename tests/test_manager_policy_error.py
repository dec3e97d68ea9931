"""`prepare_store` is atomic under a policy error: a policy that raises while the new blocks are
inserted leaves the first tier as it was (no slot allocated, no key resident or pinned), and the
error propagates (`None` would say "no room", which is not what happened)."""

from __future__ import annotations

import pytest
from conftest import keys, memory_hierarchy

from kvtier import ReqContext
from kvtier.policies.base import CachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy

BAD = keys(1, start=100)[0]
CTX = ReqContext("policy-error")


class RefusingLRU(PureLRUCachePolicy):
    """The pure-Python LRU raising on `BAD`, inserting a request's blocks one by one
    (`CachePolicy`'s default loop, reached through `PolicyTable.insert_written`) as a
    third-party policy may."""

    insert_many = CachePolicy.insert_many

    def insert(self, key, block):
        if key == BAD:
            raise RuntimeError("this policy refuses the key")
        super().insert(key, block)


def tier_state(tier) -> tuple:
    return (tier.backend.get_num_free_blocks(), sorted(tier.policy.keys()),
            sorted(tier.table.pinned_keys() or ()))


def test_policy_error_leaves_tier_as_before():
    manager = memory_hierarchy(hot=8, hot_policy="test_manager_policy_error:RefusingLRU").manager
    top = manager.tiers[0]
    first = keys(2)
    out = manager.prepare_store(first, CTX)
    assert out is not None
    manager.complete_store(first, CTX)
    before = tier_state(top)
    # Inserted last key first: the two keys after BAD are in the policy when it raises.
    request = [*keys(2), *keys(1, start=10), BAD, *keys(2, start=11)]
    with pytest.raises(RuntimeError, match="refuses the key"):
        manager.prepare_store(request, CTX)
    assert tier_state(top) == before
    # The tier still works: the same request without the refused key is stored in full.
    good = [k for k in request if k != BAD]
    out = manager.prepare_store(good, CTX)
    assert out is not None and list(out.keys_to_store) == good[2:]
    manager.complete_store(good, CTX)
    assert tier_state(top)[0] == before[0] - 3
