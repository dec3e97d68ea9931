"""kvtier's eviction policies inside vLLM's own `CPUOffloadingManager`, for users who want only the
policy (vLLM's CPU offloading, kvtier's choice of which blocks leave it)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8589934592,
        "eviction_policy": "PrefixFreqPolicy",
        "cache_policy_module_path": "kvtier.integrations.vllm.policies"}}'

vLLM's `CachePolicyFactory` imports `cache_policy_module_path` and takes the class named by
`eviction_policy` from it (vLLM 0.32). One adapter class per kvtier policy: `LRUPolicy`,
`ARCPolicy`, `SievePolicy`, `PrefixFreqPolicy` (`lru`, `arc`, `sieve`, `prefix-freq`, the
compiled index where it is built).

How vLLM's calls map onto kvtier's policy (`KVTierCachePolicy`):

* vLLM's manager keeps and changes its own `ChunkStatus` objects (`ref_cnt`, `chunk_id`); the
  adapter hands those back from `get` and `evict`, and gives the kvtier policy a `BlockStatus` of
  its own (same slot id) whose `ref_cnt` follows vLLM's evictability: 0 after `mark_evictable`, 1
  after `mark_non_evictable`, the chunk's at insertion (-1 while it is being written). kvtier's
  policy therefore evicts exactly the chunks vLLM's manager considers evictable.
* Insertion: vLLM inserts one store's new blocks one call each, head to tail. The adapter hands
  them to the kvtier policy at its next call that needs them (`evict`, `touch`, a `mark_*`, ...)
  in one `insert_many`, tail first with `tail=` the store's last block, as kvtier's own manager
  does: a prefix is evicted tail first, and `prefix-freq` sees which block is the tail.
* `touch(keys)` is kvtier's `touch` (`CachePolicy.touch`: in `LRUPolicy`, `ARCPolicy` and
  `PrefixFreqPolicy` the first key ends up the most recent, as in vLLM's LRU; `SievePolicy` only
  marks the keys visited).
* `on_request_finished` touches the request's keys once, in the request's head-to-tail order
  across KV-cache groups (vLLM's `order_request_keys`), leaving out the keys the request only
  inserted: kvtier's policies take a touch as a reuse (`prefix-freq` counts it, `arc` moves the
  block to its frequent list), and a block stored by this request was placed by its insertion
  (tail first, so the order is the one vLLM's LRU gets by touching them).
* `on_store_miss`: nothing more (the keys are not resident; kvtier's `arc` learns of a ghost hit
  at insertion). `clear` builds a new kvtier policy, so ghost lists and adaptive state reset too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies import base as _vllm_policies
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from kvtier.core.types import BlockStatus


def _concatenated(key_groups: Sequence[Sequence[OffloadKey]], req_context: ReqContext) -> list[OffloadKey]:
    return [key for group in key_groups for key in group]


# vLLM 0.32's request order across KV-cache groups; the groups one after another where it is absent
order_request_keys: Any = getattr(_vllm_policies, "order_request_keys", _concatenated)

__all__ = ["ARCPolicy", "KVTierCachePolicy", "LRUPolicy", "PrefixFreqPolicy", "SievePolicy"]


class KVTierCachePolicy(CachePolicy):
    """vLLM `CachePolicy` over the kvtier policy named by `kvtier_policy` (see the module docstring)."""

    kvtier_policy: ClassVar[str] = "lru"

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self._chunks: dict[OffloadKey, ChunkStatus] = {}  # vLLM's objects, as vLLM gave them
        self._pending: list[OffloadKey] = []  # inserted, not yet handed to the kvtier policy
        self._policy = self._new_policy()

    @property
    def policy(self) -> Any:
        """The kvtier policy this adapter drives (a new one after `clear`), e.g. to read its state;
        inserts reach it at the adapter's next call that needs them (see the module docstring)."""
        return self._policy

    def _new_policy(self) -> Any:
        from kvtier.policies.base import with_key_index
        from kvtier.transfer import registry

        cls = registry.load_class(registry.POLICY, self.kvtier_policy, "eviction_policy")
        return with_key_index(cls(self.cache_capacity))

    def _flush(self) -> None:
        """Hand the pending inserts to the kvtier policy, tail first with `tail=` the last key
        inserted, as kvtier's own manager inserts a request's new blocks."""
        if not self._pending:
            return
        keys, self._pending = self._pending[::-1], []
        blocks = []
        for key in keys:
            block = BlockStatus(self._chunks[key].chunk_id)
            block.ref_cnt = self._chunks[key].ref_cnt
            blocks.append(block)
        self._policy.insert_many(keys, blocks, tail=keys[0])

    def _set_ref_cnt(self, key: OffloadKey, ref_cnt: int) -> None:
        self._flush()
        block = self._policy.get(key)
        if block is not None:  # (a view of the policy's own state for compiled policies)
            block.ref_cnt = ref_cnt

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self._chunks[key] = chunk
        self._pending.append(key)

    def remove(self, key: OffloadKey) -> None:
        self._flush()
        self._policy.remove(key)
        self._chunks.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._flush()
        self._policy.touch(list(keys))

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._flush()  # (the keys are not resident; this separates one store's inserts from the last's)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        self._flush()
        keys = [key for key in order_request_keys(key_groups, req_context) if key not in insertion_only_keys]
        if keys:
            self._policy.touch(keys)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        self._flush()
        evicted = self._policy.evict(n, protected)
        if evicted is None:
            return None
        return [(key, self._chunks.pop(key)) for key, _ in evicted]

    def clear(self) -> None:
        self._chunks.clear()
        self._pending = []
        self._policy = self._new_policy()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._set_ref_cnt(key, 0)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._set_ref_cnt(key, 1)


class LRUPolicy(KVTierCachePolicy):
    """kvtier's `lru` inside vLLM's CPU manager."""

    kvtier_policy = "lru"


class ARCPolicy(KVTierCachePolicy):
    """kvtier's `arc` inside vLLM's CPU manager."""

    kvtier_policy = "arc"


class SievePolicy(KVTierCachePolicy):
    """kvtier's `sieve` inside vLLM's CPU manager."""

    kvtier_policy = "sieve"


class PrefixFreqPolicy(KVTierCachePolicy):
    """kvtier's `prefix-freq` (prefix-aware) inside vLLM's CPU manager."""

    kvtier_policy = "prefix-freq"
