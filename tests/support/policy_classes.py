"""Policy classes that cannot be built, or do not follow kvtier's contract, for
tests/test_policy_loading.py (named in YAML as `tests.support.policy_classes:Name`)."""

from __future__ import annotations

from kvtier.core.keys import make_offload_key
from kvtier.core.types import BlockStatus
from kvtier.policies.base import CachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy


class Abstract(CachePolicy):
    """Does not implement evict."""

    def get(self, key):
        return None

    def insert(self, key, block):
        pass

    def remove(self, key):
        pass

    def touch(self, keys):
        pass


class TakesNoCapacity(PureLRUCachePolicy):
    """A complete policy whose __init__ takes no capacity."""

    def __init__(self):
        super().__init__(10)


class RaisesInInit(PureLRUCachePolicy):
    def __init__(self, cache_capacity):
        raise RuntimeError("boom in __init__")


class VllmShaped:
    """vLLM's own CachePolicy contract, duck-typed (no vllm needed): the five methods, touch with a
    req_context, and blocks evictable only after mark_evictable."""

    def __init__(self, cache_capacity):
        self.blocks: dict = {}
        self.evictable_keys: set = set()

    def get(self, key):
        return self.blocks.get(key)

    def insert(self, key, block):
        self.blocks[key] = block

    def remove(self, key):
        self.blocks.pop(key, None)

    def touch(self, keys, req_context):
        pass

    def mark_evictable(self, key):
        self.evictable_keys.add(key)

    def evict(self, n, protected):
        return None


class NeverRefuses(PureLRUCachePolicy):
    """evict(n) names made-up blocks and removes nothing, so it never returns None; after
    `GUARD_CALLS` calls it raises `StillCalled` (so a suite that loops on it ends anyway)."""

    GUARD_CALLS = 10_000
    calls = 0

    def evict(self, n, protected):
        if n <= 0:
            return []
        NeverRefuses.calls += 1
        if NeverRefuses.calls > self.GUARD_CALLS:
            raise StillCalled(f"evict called {NeverRefuses.calls} times")
        return [(make_offload_key(b"ghost%d" % i, 0), BlockStatus(0)) for i in range(n)]


class StillCalled(Exception):
    """NeverRefuses's guard: the suite kept calling evict."""


class NoticeForgets(PureLRUCachePolicy):
    """Counts pins by the table's notices (`evictable`) but ignores the notice that a block became
    evictable again: once unpinned, a block still counts as pinned, and `evict` refuses early."""

    def evictable(self, keys, flag):
        if not flag:
            super().evictable(keys, flag)
