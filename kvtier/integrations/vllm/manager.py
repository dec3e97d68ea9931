"""Scheduler side: vLLM's `OffloadingManager` over a kvtier hierarchy, and its metrics."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvtier.integrations.vllm.translate import KVTierCPULoadStoreSpec, _to_vllm_spec, to_vllm_medium

try:  # vLLM >= 0.31 reports where a hit came from; tolerate its absence
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover
    CacheHitSource = None  # type: ignore[assignment,misc]

METRIC_PREFIX = "vllm:kvtier_"
# Per-tier counters of HierarchyManager.get_stats(), exported as deltas labelled by tier.
_COUNTERS: dict[str, str] = {
    "hits": "Blocks loaded into the engine's KV cache that this tier supplied (directly or by promotion).",
    "stores": "Blocks written into this tier (engine stores, demotions, promotions).",
    "evictions": "Blocks evicted from this tier.",
    "demotions": "Blocks copied from this tier to the next one (cascade).",
    "promotions": "Blocks copied from this tier up to the first tier.",
    "cascade_dropped": "Blocks evicted from this tier before a copy reached the next tier.",
    "cascade_dropped_failed": "Of cascade_dropped (write-through): blocks whose copy to the next tier failed.",
    "cascade_dropped_full": "Of cascade_dropped (write-through): blocks the next tier had no room for or evicted.",
    "cascade_deferred": "Blocks whose copy to the next tier waited for in-flight room (backpressure).",
    "failures": "Failed transfer jobs that read from or wrote into this tier.",
    "bytes_in": "Bytes written into this tier by cascade and promotion jobs.",
    "bytes_out": "Bytes read from this tier by cascade and promotion jobs.",
    "seconds_in": "Seconds spent by jobs writing into this tier.",
    "seconds_out": "Seconds spent by jobs reading from this tier.",
}
_GAUGES: dict[str, str] = {
    "resident_blocks": "Blocks currently held by this tier.",
    "usage_perc": "Fraction of this tier's capacity currently used (0.0 - 1.0).",
    "capacity_blocks": "Capacity of this tier in blocks.",
}


class KVTierOffloadingManager(OffloadingManager):
    """vLLM `OffloadingManager` over a kvtier `Hierarchy` (runs on the scheduler thread).

    Converts vLLM's calls and types to kvtier's and back: lookup results by name, kvtier CPU specs
    to `KVTierCPULoadStoreSpec`, kvtier events to vLLM `OffloadingEvent`s (medium CPU / STORAGE,
    `ownership` = tier name for tiers below the first), per-tier stats to
    `OffloadingConnectorStats` (counter deltas and gauges labelled by tier). Never blocks on I/O:
    kvtier's manager only submits jobs, and their completions are collected on later calls.
    """

    def __init__(self, hierarchy: Any, enable_events: bool = False):
        self.hierarchy = hierarchy
        self.manager = hierarchy.manager
        self.enable_events = enable_events
        self._last_counters: dict[str, dict[str, float]] = {}
        # token of the shared CPU region, sent with every spec: the worker maps only this region
        self.region_token = getattr(self.manager.tiers[0].backend, "token", None)
        self._lock = threading.RLock()

    if "lock" in getattr(OffloadingManager, "__abstractmethods__", frozenset()):  # vLLM 0.33+, if abstract
        @property
        def lock(self):
            """Guards the manager when vLLM calls it from more than one thread."""
            return self._lock

    # --- lookup and load
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult[self.manager.lookup(key, req_context).name]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext):
        if CacheHitSource is None:  # pragma: no cover
            return None
        medium = self.manager.load_source(key) or "CPU"
        return CacheHitSource.HOST if medium == "CPU" else CacheHitSource.DISK

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> KVTierCPULoadStoreSpec:
        keys = list(keys)
        spec = self.manager.prepare_load(keys, req_context)
        # vLLM 0.32's connector never calls touch(): recency is the manager's business. A load is
        # a reuse, so the loaded prefix becomes the most recently used (head first), as in replays.
        self.manager.touch(keys, req_context)
        return _to_vllm_spec(spec, self.region_token)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch(list(keys), req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.complete_load(list(keys), req_context)

    # --- store
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        out = self.manager.prepare_store(list(keys), req_context)
        if out is None:
            return None
        return PrepareStoreOutput(keys_to_store=list(out.keys_to_store),
                                  store_spec=_to_vllm_spec(out.store_spec, self.region_token),
                                  evicted_keys=list(out.evicted_keys))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.manager.complete_store(list(keys), req_context, success=success)

    # --- requests and steps
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.manager.on_new_request(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.manager.on_request_finished(req_context)

    def on_schedule_end(self, context: Any = None) -> None:
        self.manager.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return self.manager.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        top = self.manager.tiers[0].name
        for event in self.manager.take_events():
            yield _make_event(list(event.keys), to_vllm_medium(event.medium), event.removed,
                              None if event.tier == top else event.tier)

    def reset_cache(self) -> None:
        self.manager.reset_cache()

    def on_reset_flushed(self) -> None:  # vLLM 0.33: in-flight jobs were flushed after a reset
        return

    def config_info(self) -> dict[str, Any]:  # vLLM 0.33
        return {"kvtier_tiers": [f"{t.name}:{t.medium}:{t.capacity}" for t in self.manager.tiers]}

    # --- metrics
    def get_stats(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for tier, values in self.manager.get_stats().items():
            last = self._last_counters.setdefault(tier, {})
            for name in _COUNTERS:
                now = values.get(name, 0)
                delta = now - last.get(name, 0)
                last[name] = now
                if delta:
                    stats.increase_counter(METRIC_PREFIX + name, delta, (tier,))
            capacity = values.get("capacity_blocks") or 0
            resident = values.get("resident_blocks", 0)
            stats.set_gauge(METRIC_PREFIX + "resident_blocks", resident, (tier,))
            stats.set_gauge(METRIC_PREFIX + "capacity_blocks", capacity, (tier,))
            stats.set_gauge(METRIC_PREFIX + "usage_perc", resident / capacity if capacity else 0.0, (tier,))
        return stats

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        """kvtier's cumulative per-tier counters (tests, bench)."""
        return self.manager.get_stats()

    def shutdown(self) -> None:
        self.hierarchy.close()


_EVENT_FIELDS = {f.name for f in dataclasses.fields(OffloadingEvent)}


def _make_event(keys: list, medium: Medium, removed: bool, ownership: str | None) -> OffloadingEvent:
    kwargs: dict[str, Any] = {"keys": keys, "medium": medium, "removed": removed}
    if "ownership" in _EVENT_FIELDS:
        kwargs["ownership"] = ownership
    if "locality" in _EVENT_FIELDS:
        from vllm.v1.kv_offload.base import Locality

        kwargs["locality"] = Locality.LOCAL
    return OffloadingEvent(**kwargs)

