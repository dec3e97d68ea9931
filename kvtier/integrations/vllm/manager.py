"""Scheduler side: vLLM's `OffloadingManager` over a kvtier hierarchy, and its metrics."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvtier.control.request_access import RequestAccesses, request_order, several_groups
from kvtier.control.store_threshold import DEFAULT_MAX_TRACKER_SIZE, StoreThreshold
from kvtier.control.tier import TierStats
from kvtier.integrations.vllm.retention_metrics import RetainedGauges, record_retention
from kvtier.integrations.vllm.translate import _to_vllm_spec, to_vllm_medium
from kvtier.integrations.vllm.vllm_metrics import STORES_SKIPPED, record_first_tier, record_lower_tier

try:  # vLLM >= 0.31 reports where a hit came from; tolerate its absence
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover
    CacheHitSource = None  # type: ignore[assignment,misc]

METRIC_PREFIX = "vllm:kvtier_"
# How long shutdown waits for the CPU tier's blocks to be copied down (`KVTierOffloadingManager.shutdown`).
SHUTDOWN_FLUSH_S = 30.0
log = logging.getLogger(__name__)
# What each `TierStats` counter counts, for its Prometheus help text.
_COUNTER_DOCS: dict[str, str] = {
    "hits": ("Blocks loaded into the engine's KV cache that this tier supplied (directly or by promotion); "
             "a block whose load failed is not one."),
    "stores": "Blocks written into this tier (engine stores, demotions, promotions).",
    "evictions": "Blocks evicted from this tier.",
    "demotions": "Blocks copied from this tier to the next one (cascade).",
    "promotions": "Blocks copied from this tier up to the first tier.",
    "cascade_dropped": "Blocks evicted from this tier before a copy reached the next tier.",
    "cascade_dropped_failed": "Of cascade_dropped: blocks whose copy to the next tier failed (the only ones let go).",
    "cascade_dropped_full": "Of cascade_dropped: any other (a policy evicting past its victim order); 0 otherwise.",
    "cascade_deferred": "Blocks whose copy to the next tier waited for in-flight room (backpressure), once a wait.",
    "failures": "Blocks whose copy into or out of this tier failed (each counted once).",
    "publish_dropped": "Shared tier: blocks not published (in-flight bound, slow writes, server down, no room).",
    "probes": "Shared tier: probe batches sent to the server (at most one per scheduler step).",
    "probe_keys": "Shared tier: keys in those probe batches.",
    "probe_hits": "Shared tier: probed keys found on the server.",
    "probe_failures": "Shared tier: probe batches that failed (their keys answered MISS).",
    "probe_timeouts": "Shared tier: probed keys not answered within the timeout (answered MISS).",
    "breaker_misses": "Shared tier: lookups answered MISS at once because the server was considered down.",
    "rejected": "Blocks a promotion from this tier could not read (gone, failed verification, unreachable).",
    "bytes_in": "Bytes written into this tier by cascade and promotion jobs.",
    "bytes_out": "Bytes read from this tier by cascade and promotion jobs.",
    "seconds_in": "Seconds spent by jobs writing into this tier.",
    "seconds_out": "Seconds spent by jobs reading from this tier.",
}
# Every `TierStats` counter, exported as deltas labelled by tier. Derived from the dataclass's
# fields, so a counter added there is exported without a change here.
KVTIER_COUNTERS: dict[str, str] = {f.name: _COUNTER_DOCS.get(f.name, f"kvtier TierStats.{f.name}.")
                                   for f in dataclasses.fields(TierStats)}
KVTIER_GAUGES: dict[str, str] = {
    "resident_blocks": "Blocks currently held by this tier.",
    "usage_perc": "Fraction of this tier's capacity currently used (0.0 - 1.0).",
    "capacity_blocks": "Capacity of this tier in blocks.",
    "retained_blocks": "Blocks of this tier kept by sessions' retention hints now.",
    "ended_blocks": "Blocks of this tier from ended sessions, to be evicted first.",
}


# Policies for which a touch is recency only: a request's end touches every key it observed, the
# ones it only stored too, as vLLM's LRU does. The others count a touch as a reuse (`arc` moves the
# block to its frequent list, `sieve` sets its visited bit, `prefix-freq` counts it), so only the
# keys the request reused are touched; its new blocks keep the place their insertion gave them.
RECENCY_ONLY_POLICIES = frozenset({"lru"})


def touches_insertions(policy: str | None) -> bool:
    """Whether a request's end touches the keys it only stored (see `RECENCY_ONLY_POLICIES`)."""
    return policy in RECENCY_ONLY_POLICIES


def failed_last(keys: list[OffloadKey], bad: Collection[OffloadKey] | None) -> tuple[list[OffloadKey],
                                                                                    list[OffloadKey]]:
    """A failed load's `keys` and those of them that failed (`bad`; None: every one), the failed
    ones listed last: vLLM completes a load's keys as a set, which does not say which blocks came
    after the first failed one (vLLM recomputes those), and `HierarchyManager.complete_load`
    counts as hits the keys before the first failed one, so every block loaded counts."""
    if bad is None:
        return keys, keys
    failed = [key for key in keys if key in bad]
    return ([key for key in keys if key not in bad] + failed if failed else keys), failed


def _in_offer_order(out: Any, offer: list[OffloadKey]) -> Any:
    """kvtier's `prepare_store` answer `out` with its keys to store, and their slots in its CPU
    spec, put in the order of `offer` (the same keys and slots)."""
    slots = dict(zip(out.keys_to_store, out.store_spec.block_ids))
    keys = [key for key in offer if key in slots]
    spec = type(out.store_spec)([slots[key] for key in keys], out.store_spec.tier)
    return dataclasses.replace(out, keys_to_store=keys, store_spec=spec)


class KVTierOffloadingManager(OffloadingManager):
    """vLLM `OffloadingManager` over a kvtier `Hierarchy` (runs on the scheduler thread).

    Converts vLLM's calls and types to kvtier's and back: lookup results by name, kvtier CPU specs
    to `KVTierCPULoadStoreSpec` (file-tier and composite specs where file tiers are loaded
    directly: `translate`), kvtier events to vLLM `OffloadingEvent`s (medium CPU / STORAGE,
    `ownership` = tier name for tiers below the first), per-tier stats to
    `OffloadingConnectorStats` (counter deltas and gauges labelled by tier). Never blocks on I/O:
    kvtier's manager only submits jobs, and their completions are collected on later calls.

    Threads. The manager's state (policies, pins, job tables) is only ever touched by calls into
    this object: kvtier's CPU<->FILE handlers run on their own threads but only move bytes and
    report each finished job through the router's thread-safe queue, which the manager
    drains on the caller's thread. vLLM calls it from the scheduler thread only, so vLLM's no-op
    lock would do today; `lock` is a real re-entrant lock all the same (uncontended, it costs
    ~0.1 us a step): a caller on another thread (kvtier's `tier_stats`, a bench, a future vLLM
    poll thread) that holds it cannot interleave with the scheduler's step, and one that
    re-enters it on the same thread does not deadlock.
    """

    def __init__(self, hierarchy: Any, enable_events: bool = False, store_threshold: int | None = None,
                 max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE):
        """`store_threshold`: offers before a block is stored (`kvtier.control.store_threshold`; None:
        the hierarchy config's `store_threshold`); `max_tracker_size`: keys its table counts."""
        self.hierarchy = hierarchy
        self.manager = hierarchy.manager
        self._top = hierarchy.first_tier  # (the first tier never changes)
        self.enable_events = enable_events
        self._last_counters: dict[str, dict[str, float]] = {}
        self._rows = RetainedGauges()  # (the tiers' retained blocks, recounted at most once a second)
        # token of the shared CPU region, sent with every spec: the worker maps only this region
        self.region_token = getattr(hierarchy.first_backend, "token", None)
        # each file tier's manifest digest, sent with its slots: the worker checks it read that tier
        self._identities = {t.name: t.backend.digest for t in self.manager.tiers
                            if isinstance(getattr(t.backend, "digest", None), bytes)}
        self._lock = threading.RLock()
        # The engine's transfers not yet completed: keys being stored, keys pinned by loads (one
        # entry per pin). A cache reset moves them to the flushed ones, which the engine never
        # completes; `on_reset_flushed` releases those once its workers are done with them.
        self._storing: set[OffloadKey] = set()
        self._loading: dict[OffloadKey, int] = {}
        self._flushed_storing: set[OffloadKey] = set()
        self._flushed_loading: list[OffloadKey] = []
        # blocks each prepare_store asked for since the last get_stats, refused or not (vLLM's allocation histogram)
        self._allocation_sizes: list[int] = []
        # Each open request's accesses, applied in one touch when it finishes (vLLM 0.32's recency).
        self._accesses: RequestAccesses[OffloadKey] = RequestAccesses()
        self._touch_insertions = touches_insertions(hierarchy.config.tiers[0].policy)
        threshold = hierarchy.config.store_threshold if store_threshold is None else store_threshold
        self.store_threshold: StoreThreshold[OffloadKey] = StoreThreshold(threshold, max_tracker_size)
        self._last_skipped = 0
        self.direct_file_loads: Any = None  # the spec's `DirectFileLoads`, enabled by KVTierOffloadingConnector

    @property
    def lock(self) -> threading.RLock:
        """vLLM 0.33: held by every caller across dependent calls (a lookup HIT and the
        prepare_load that pins it); a real re-entrant lock (see the class docstring)."""
        return self._lock

    # --- lookup and load
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult[self.manager.lookup(key, req_context).name]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext):
        if CacheHitSource is None:  # pragma: no cover
            return None
        medium = self.manager.load_source(key) or "CPU"
        return CacheHitSource.HOST if medium == "CPU" else CacheHitSource.DISK

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        spec = self.manager.prepare_load(keys, req_context)
        loading = self._loading
        for key in keys:
            loading[key] = loading.get(key, 0) + 1
        # A load is a reuse, applied when the request finishes (vLLM 0.32's connector never
        # calls touch(): recency is the manager's business, recorded per request).
        self._accesses.record(keys, req_context, reused=keys)
        return _to_vllm_spec(spec, self.region_token, self._identities)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch(list(keys), req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        self.manager.complete_load(keys, req_context)
        self._unpinned(keys)

    def _unpinned(self, keys: list[OffloadKey]) -> None:
        loading = self._loading
        for key in keys:
            left = loading.pop(key, 0) - 1
            if left > 0:
                loading[key] = left

    def complete_failed_load(self, keys: Collection[OffloadKey], req_context: ReqContext,
                             bad: Collection[OffloadKey] | None = None) -> None:
        """`complete_load` of a load that failed in a worker (`KVTierOffloadingConnector`): `bad`
        names the keys whose blocks failed (None: every one of `keys`). Those are dropped from the
        tier the load read them from (the first tier, or a file tier loaded directly, whose block
        failed verification in the worker), each counted once in its `failures`
        (`vllm:kvtier_failures`) and never answered HIT again, so vLLM's recompute does not load
        them again; the load's other blocks stay (`HierarchyManager.complete_load`), and count
        as hits (`vllm:kvtier_hits`; the failed ones do not: `failed_last`)."""
        keys, failed = failed_last(list(keys), bad)
        self.manager.complete_load(keys, req_context, failed=failed)
        self._unpinned(keys)

    # --- store
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """vLLM's `prepare_store`: the offer's readable keys count as the request's reuses, its
        absent keys are the store candidates (recorded as the request's once stored), less those
        the store threshold skips (`kvtier.control.store_threshold`: never recorded, never stored). A call
        naming several KV-cache groups is put in the request's order first (`request_order`:
        by key position, then group), so that its tail-first insertion leaves each group's head
        the most recent and the call's tails the least, as vLLM's order does; the answer still
        lists the keys to store (and their slots) in the offer's order, group after group, the
        order in which vLLM's scheduler lists the engine blocks of the store job."""
        offer = list(keys)
        keys = request_order(offer, req_context) if len(offer) > 1 and several_groups(offer) else offer
        top = self._top
        absent = set(self.manager.stores.new_keys(keys))
        if self.store_threshold.enabled:
            keys = self.store_threshold.admit(keys, absent)
        accesses = self._accesses
        if len(absent) == len(keys):  # (the common case: nothing held yet)
            accesses.record(keys, req_context)
        else:
            ready = [key for key in keys if key not in absent and top.readable(key) is not None]
            observed = absent.union(ready)  # (not: blocks still being written)
            accesses.record([key for key in keys if key in observed], req_context, reused=ready)
        new = len(absent.intersection(keys))
        if new:  # (as vLLM: every allocation asked for, refused ones too)
            self._allocation_sizes.append(new)
        out = self.manager.prepare_store(keys, req_context)
        if out is None:
            return None
        accesses.inserted(out.keys_to_store, req_context)
        self._storing.update(out.keys_to_store)
        if keys is not offer:
            out = _in_offer_order(out, offer)
        return PrepareStoreOutput(keys_to_store=list(out.keys_to_store),
                                  store_spec=_to_vllm_spec(out.store_spec, self.region_token),
                                  evicted_keys=list(out.evicted_keys))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        keys = list(keys)
        self.manager.complete_store(keys, req_context, success=success)
        self._storing.difference_update(keys)

    # --- requests and steps
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self.direct_file_loads is not None:  # the file tiers' load path is settled by now: logged once
            self.direct_file_loads.settle()
        self.manager.on_new_request(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """The request's accesses, in its head-to-tail order, become the most recent (one
        `touch`; see `kvtier.control.request_access` and `touches_insertions`)."""
        keys = self._accesses.finish(req_context, insertions=self._touch_insertions)
        if keys:
            self.manager.touch(keys, req_context)
        self.manager.on_request_finished(req_context)

    def on_schedule_end(self, context: Any = None) -> None:
        self.manager.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return self.manager.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        top = self.hierarchy.first_tier.name
        for event in self.manager.take_events():
            yield _make_event(list(event.keys), to_vllm_medium(event.medium), event.removed,
                              None if event.tier == top else event.tier)

    def reset_cache(self) -> None:
        """Evict every block no transfer uses. The engine flushes its transfers in flight and
        never completes them: their blocks (being stored, or pinned by a load) stay, slots
        untouched, until `on_reset_flushed` says no worker writes or reads them any more."""
        self._flushed_storing |= self._storing
        self._flushed_loading.extend(k for k, n in self._loading.items() for _ in range(n))
        self._storing, self._loading = set(), {}
        self._accesses.clear()
        self.manager.reset_cache()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: every transfer in flight at the last reset was reported by the workers.
        Finishes the reset: the blocks those transfers were storing are dropped (never
        completed, maybe partly written), those they were loading unpinned and evicted unless
        pinned again since; their slots are free for new stores. (vLLM 0.32 never calls this:
        such blocks stay until the engine stops - at most one reset's transfers in flight.)"""
        storing, loading = self._flushed_storing, self._flushed_loading
        self._flushed_storing, self._flushed_loading = set(), []
        if storing or loading:
            self.manager.finish_reset(storing, loading)

    def config_info(self) -> list[dict[str, str | int | float | bool]]:
        """vLLM 0.33: the labels of `vllm:kv_offload_config_info`, one series per tier (first
        tier first), under the names `KVTierOffloadingSpec.config_info_keys` declares."""
        return [_tier_info(tier, self.hierarchy) for tier in self.manager.tiers]

    # --- metrics
    def get_stats(self):
        """kvtier's per-tier metrics (`vllm:kvtier_*`: counter deltas since the last call, gauges:
        `RetainedGauges`) and vLLM's own names with the same meaning (`vllm_metrics`)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for index, (tier, values) in enumerate(self._rows.rows(self.manager).items()):
            last = self._last_counters.setdefault(tier, {})
            deltas: dict[str, float] = {}
            for name in KVTIER_COUNTERS:
                now = values.get(name, 0)
                deltas[name] = delta = now - last.get(name, 0)
                last[name] = now
                if delta:
                    stats.increase_counter(METRIC_PREFIX + name, delta, (tier,))
            if index:
                record_lower_tier(stats, tier, deltas)
            capacity, resident = values.get("capacity_blocks") or 0, values.get("resident_blocks", 0)
            for gauge in ("resident_blocks", "capacity_blocks", "retained_blocks", "ended_blocks"):
                stats.set_gauge(METRIC_PREFIX + gauge, values.get(gauge, 0), (tier,))
            stats.set_gauge(METRIC_PREFIX + "usage_perc", resident / capacity if capacity else 0.0, (tier,))
        sizes, self._allocation_sizes = self._allocation_sizes, []
        record_first_tier(stats, self.hierarchy.first_tier, len(self._storing), sizes)
        if self.store_threshold.enabled:  # as vLLM: reported (0 included) only with a threshold
            skipped = self.store_threshold.skipped
            stats.increase_counter(STORES_SKIPPED, skipped - self._last_skipped)
            self._last_skipped = skipped
        return record_retention(stats, self.manager.retention.report(), self._last_counters.setdefault("", {}))

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        """kvtier's cumulative per-tier counters (tests, bench); safe from any thread."""
        with self._lock:
            return self.manager.get_stats()

    def shutdown(self) -> None:
        """Copy down every block that has no copy in the tier below (at most `SHUTDOWN_FLUSH_S`
        seconds: an `on_evict` tier would otherwise keep them only in the CPU tier, lost with the
        process, where a standalone `KVTier.close` keeps them), then close the hierarchy (also when
        the flush raises: the error goes on after the close)."""
        try:
            left = self.hierarchy.manager.flush(SHUTDOWN_FLUSH_S)
            if left:
                log.warning("kvtier: %d block(s) not copied below within %.0f s of shutdown; they are not "
                            "kept for the next start", left, SHUTDOWN_FLUSH_S)
        finally:
            self.hierarchy.close()


# Labels of `vllm:kv_offload_config_info` (vLLM 0.33), one series per tier; "" where not applicable.
CONFIG_INFO_KEYS = ("tier", "kvtier_medium", "kvtier_capacity_blocks", "kvtier_block_tokens", "kvtier_block_bytes",
                    "kvtier_cascade", "kvtier_root_dir", "kvtier_fingerprint", "kvtier_config")


def _tier_info(tier: Any, hierarchy: Any) -> dict[str, str | int | float | bool]:
    """One tier's `config_info` series: its place, size and, for a file tier, where and whose."""
    options: dict[str, Any] = next((t.options for t in hierarchy.config.tiers if t.name == tier.name), {})
    backend = tier.backend
    values = (tier.name, tier.medium, tier.capacity, backend.block_size, backend.block_bytes,
              tier.cascade if tier.below is not None else "", str(getattr(backend, "root", "") or ""),
              str(options.get("fingerprint") or ""), str(hierarchy.config.source or ""))
    return dict(zip(CONFIG_INFO_KEYS, values))


_EVENT_FIELDS = {f.name for f in dataclasses.fields(OffloadingEvent)}


def _make_event(keys: list, medium: Medium, removed: bool, ownership: str | None) -> OffloadingEvent:
    kwargs: dict[str, Any] = {"keys": keys, "medium": medium, "removed": removed}
    if "ownership" in _EVENT_FIELDS:
        kwargs["ownership"] = ownership
    if "locality" in _EVENT_FIELDS:
        from vllm.v1.kv_offload.base import Locality

        kwargs["locality"] = Locality.LOCAL
    return OffloadingEvent(**kwargs)

