"""Scheduler side of `shared: host`: vLLM's `OffloadingManager` over the host owner's hierarchy.

With `shared: host` in its kvtier YAML an engine builds no tier of its own: every engine of the
same identity on the host (`KVTierOffloadingSpec.fingerprint`: model, dtype, KV layout, block
geometry, ranks) shares the one hierarchy that the host owner (`kvtier serve`, `kvtier.host`)
builds from the YAML. Only keys and slot numbers go through the owner's socket; the engine's
workers copy the bytes in and out of the owner's CPU region themselves (`host_worker`).

Failure is a miss: every owner call has the YAML's `timeout_ms` deadline (`HostClient`); when the
owner does not answer (not running, hung, restarting) `lookup` answers MISS, `prepare_store` None
(no room), a load's keys are not pinned (its worker fails them and vLLM recomputes them), and
completions are dropped (the owner releases what a departed connection held after its grace
period). A restarted owner has a new region: specs then name it, and the workers map it.

A load's pins are the owner's: `prepare_load` pins the leading run still readable, which may be
shorter than the keys vLLM loads (another engine evicted some since the lookup); the spec says how
many were pinned and the worker fails the rest, which only `KVTierOffloadingConnector` turns into
a recompute (vLLM's own connector stops the engine on a failed load: a warning says so).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvtier.config.shared import config_mapping
from kvtier.host.client import HostClient, join
from kvtier.host.namespace import LEASE_GRACE_S
from kvtier.host.wire import HostUnavailable, hex_keys
from kvtier.integrations.vllm.host_holdings import Holdings
from kvtier.integrations.vllm.manager import CONFIG_INFO_KEYS, METRIC_PREFIX, failed_last
from kvtier.integrations.vllm.retention_metrics import EngineHints, record_retention
from kvtier.integrations.vllm.translate import KVTierHostLoadStoreSpec
from kvtier.integrations.vllm.vllm_metrics import STORES_SKIPPED

try:  # vLLM >= 0.31 reports where a hit came from; tolerate its absence
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover
    CacheHitSource = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

LOOKAHEAD_KEYS = 4096  # keys a lookup asks the owner about at once (a 64 K-token prompt in 16-token blocks)
OWNER_STATS_S = 1.0  # how often `get_stats` asks the owner for its tiers' gauges
FLUSHED_RELEASE_S = LEASE_GRACE_S  # after a reset: when the transfers then in flight are released at the latest
# This engine's counters, exported as `vllm:kvtier_<name>{tier=<first tier>}` (deltas).
ENGINE_COUNTERS = {"loaded": "hits", "stored": "stores", "failures": "failures", "unavailable": "breaker_misses"}


def request_run(req_context: Any, key: OffloadKey) -> list[OffloadKey]:
    """`key` and the request's keys after it in the same KV-cache group, in prefix order, at most
    `LOOKAHEAD_KEYS`: the keys vLLM's scheduler looks up next, one by one, in the same step.

    They are read from the positions the scheduler records in the request's context before its
    lookups (`ReqContext.set_offload_key_position`; vLLM 0.32 and 0.33 keep them in one dict in
    insertion order); without them, or for a key not recorded, the run is `[key]` alone."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict) or key not in positions:
        return [key]
    keys = list(positions)
    start = keys.index(key)
    run, last = [key], positions[key]
    for following in keys[start + 1:start + LOOKAHEAD_KEYS]:
        position = positions[following]
        if position <= last:  # (another group's keys follow this group's: its run ends here)
            break
        run.append(following)
        last = position
    return run


def _keys(values: Iterable[str]) -> list[OffloadKey]:
    return [OffloadKey(bytes.fromhex(value)) for value in values]


class ReportedFailures:
    """Whether the engine's connector reports failed loads to vLLM (`KVTierOffloadingConnector`
    calls `enable`, as it does for kvtier's direct file loads); `settle` warns, once, at the first
    request when it does not: a load the owner could not wholly pin then stops the engine."""

    def __init__(self) -> None:
        self.enabled = False
        self._told = False

    def enable(self) -> bool:
        self.enabled = True
        return True

    def settle(self) -> None:
        if not self.enabled and not self._told:
            self._told = True
            log.warning("kvtier: shared: host under vLLM's OffloadingConnector: a load whose blocks another engine "
                        "evicted after the lookup fails, and this connector stops the engine on a failed load; use "
                        "KVTierOffloadingConnector (kv_load_failure_policy: recompute) so that vLLM recomputes them")


class HostOffloadingManager(OffloadingManager):
    """vLLM `OffloadingManager` forwarding to the host owner (the module docstring).

    Every call runs on the scheduler thread and waits at most `timeout_ms` for the owner (one
    call per `lookup` not answered yet this step, per `prepare_load`, `prepare_store`, completion,
    and finished request that loaded blocks). A lookup asks about the request's following keys
    too (`request_run`), and the answers are remembered until `on_schedule_end`: vLLM's scan of a
    prefix, key by key, costs one call, and so do its repeated lookups of one key in a step. A pin
    or store is completed only with the owner that granted it (`host_holdings`).
    `take_events` is empty: the shared tiers' events are the owner's, not one engine's.
    """

    def __init__(self, client: HostClient, config: Any):
        self.client = client
        self.config = config  # the engine's HierarchyConfig (the tiers it asked the owner for)
        self._lock = threading.RLock()
        self._answers: dict[OffloadKey, LookupResult] = {}  # this step's lookups
        self._deferred = False  # a lookup this step answered RETRY or HIT_PENDING: step again
        self._was_deferred = False  # ... or in the step before (`has_pending_work` is asked after its end)
        self.holdings = Holdings()  # pins and stores in flight, by connection
        self._reused: dict[str, list[OffloadKey]] = {}  # request -> keys it loaded or offered held (touched at its end)
        self.counters: Counter[str] = Counter()  # this engine's: loaded, stored, failures, unavailable, short, skipped
        self._last: Counter[str] = Counter()
        self._owner_stats: tuple[float, dict[str, Any]] = (0.0, {})  # (when, the owner's `stats` answer)
        self.hints = EngineHints()  # this engine's requests' hints, sent with their calls to the owner
        self._last_retention: dict[str, float] = {}
        self.direct_file_loads = ReportedFailures()  # (the name KVTierOffloadingConnector enables)

    @property
    def lock(self) -> threading.RLock:
        """vLLM 0.33: held by every caller across dependent calls; a real re-entrant lock."""
        return self._lock

    def _call(self, op: str, **arguments: Any) -> dict[str, Any] | None:
        """The owner's answer, or None when it gives none (logged by the client)."""
        try:
            return self.client.call(op, **arguments)
        except HostUnavailable:
            return None

    # --- lookup and load
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        answer = self._answers.get(key)
        if answer is None:
            answer = self._ask(request_run(req_context, key))
        return answer

    def _ask(self, run: list[OffloadKey]) -> LookupResult:
        """The answer for `run[0]`, asked with the keys vLLM will ask next (one owner call for a
        prefix, not one per key): the leading HITs and the first other answer are remembered."""
        reply = self._call("lookup_run", keys=hex_keys(run))
        if reply is None:
            self.counters["unavailable"] += 1
            self._answers[run[0]] = LookupResult.MISS
            return LookupResult.MISS
        hits = reply["hits"]
        self._answers.update(dict.fromkeys(run[:hits], LookupResult.HIT))
        if hits < len(run):
            answer = self._answers[run[hits]] = LookupResult[reply["next"] or "MISS"]
            self._deferred |= answer in (LookupResult.RETRY, LookupResult.HIT_PENDING)
        return self._answers[run[0]]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext):
        return None if CacheHitSource is None else CacheHitSource.HOST  # (loaded from the host's region)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin `keys` in the owner: a spec of the slots of the leading run it pinned, naming its
        region, with every key, so that the worker fails those not pinned (the module docstring)."""
        keys = list(keys)
        reply = self._call("prepare_load", keys=hex_keys(keys), hints=self.hints.of(req_context),
                           request=req_context.req_id)
        slots = [] if reply is None else list(reply["slots"])
        self.holdings.pinned(keys[:len(slots)], self.client.generation)
        if len(slots) < len(keys):
            self.counters["short"] += len(keys) - len(slots)
        self._reused.setdefault(req_context.req_id, []).extend(keys[:len(slots)])
        return self._spec(slots, keys)

    def _spec(self, slots: list[int], keys: Collection[OffloadKey] = ()) -> KVTierHostLoadStoreSpec:
        region = self.client.region or {}
        return KVTierHostLoadStoreSpec(slots, self.client.tier or None, region.get("token"), region.get("shm_name"),
                                       region.get("num_blocks", 0), keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The keys count as used in the owner, with the request's hint (an ended session's blocks
        stay its first victims, as in a private hierarchy)."""
        if keys:
            self._call("touch", keys=hex_keys(keys), hints=self.hints.of(req_context),
                       request=req_context.req_id)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.complete_failed_load(keys, req_context, bad=())

    def complete_failed_load(self, keys: Collection[OffloadKey], req_context: ReqContext,
                             bad: Collection[OffloadKey] | None = None) -> None:
        """`complete_load` of a load whose blocks `bad` failed in a worker (None: every one;
        `KVTierOffloadingConnector`): the owner unpins the keys it pinned for this connection
        and drops the failed ones among them (never those it did not pin: they were not loaded)."""
        # (the failed ones last: the owner counts as hits the keys before the first failed one)
        held, failed = failed_last(self.holdings.unpin(keys, self.client.generation), bad)
        self.counters["loaded"] += len(held) - len(failed)
        if failed:
            self.counters["failures"] += 1
        if held:
            self._call("complete_load", keys=hex_keys(held), failed=hex_keys(failed))

    # --- store
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """The owner's slots for the keys it does not hold yet (in the offer's order, the order
        of the engine blocks of vLLM's store job); None when it has no room or does not answer."""
        offer = list(keys)
        reply = self._call("prepare_store", keys=hex_keys(offer), hints=self.hints.of(req_context),
                           request=req_context.req_id)
        if reply is not None:
            self.counters["skipped"] += int(reply.get("skipped", 0))  # (the owner's store threshold)
            self._reused.setdefault(req_context.req_id, []).extend(_keys(reply.get("reused", ())))
        if reply is None or not reply["room"]:
            return None
        slots = dict(zip(_keys(reply["store"]), reply["slots"]))
        to_store = [key for key in offer if key in slots]
        self.holdings.storing(to_store, self.client.generation)
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=self._spec([slots[k] for k in to_store]),
                                  evicted_keys=_keys(reply["evicted"]))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        mine = self.holdings.stored(keys, self.client.generation)
        if success:
            self.counters["stored"] += len(mine)
        else:
            self.counters["failures"] += 1
        if mine:
            self._call("complete_store", keys=hex_keys(mine), success=bool(success))

    # --- requests and steps
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.direct_file_loads.settle()
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """The blocks the request loaded, and those it offered to `prepare_store` that the owner
        held readable, become the most recent in the owner (one `touch`), as vLLM 0.32's
        recency per request does for a private hierarchy."""
        reused = self._reused.pop(req_context.req_id, None)
        if reused:
            self.touch(list(dict.fromkeys(reused)), req_context)

    def on_schedule_end(self, context: Any = None) -> None:
        """A step's end: its lookups are forgotten; the transfers in flight at a reset are
        released once `FLUSHED_RELEASE_S` passed, when vLLM (0.32) never said they were flushed."""
        self._answers.clear()
        self._was_deferred, self._deferred = self._deferred, False
        if self.holdings.flushed and time.monotonic() - self.holdings.flushed_at >= FLUSHED_RELEASE_S:
            log.info("kvtier: releasing the host owner's pins and stores of transfers in flight at a cache reset "
                     "%g s ago", FLUSHED_RELEASE_S)
            self.on_reset_flushed()

    def has_pending_work(self) -> bool:
        """True after a step whose lookups the owner deferred (RETRY, HIT_PENDING), so that the
        engine steps again and asks anew; the owner does its own copies."""
        return self._deferred or self._was_deferred

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Always empty: the shared tiers' block events are the owner's (class docstring)."""
        return iter(())

    def reset_cache(self) -> None:
        """This engine's cache reset leaves the shared tiers alone (other engines use them). The
        transfers in flight, which the engine never completes, are released by `on_reset_flushed`
        (vLLM 0.33), or `FLUSHED_RELEASE_S` after the reset (vLLM 0.32 never calls it): as long as
        the owner keeps a departed engine's, for its worker may still be copying."""
        self.holdings.reset()
        self._answers, self._reused = {}, {}

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: no worker uses the transfers in flight at the last reset any more: release
        their pins and drop their stores in the owner."""
        held, stores = self.holdings.take_flushed(self.client.generation)
        if held:
            self._call("complete_load", keys=hex_keys(held), failed=[])
        if stores:
            self._call("complete_store", keys=hex_keys(stores), success=False)

    def config_info(self) -> list[dict[str, str | int | float | bool]]:
        """vLLM 0.33: one `vllm:kv_offload_config_info` series per tier the engine asked for."""
        source = f"shared: host ({self.client.shared.socket})"
        region = self.client.region or {}
        return [dict(zip(CONFIG_INFO_KEYS, (
            tier.name, "CPU" if i == 0 else "STORAGE",
            region.get("num_blocks", 0) if i == 0 else (tier.capacity.blocks or 0), self.config.block_tokens,
            region.get("block_bytes", 0), tier.cascade if i + 1 < len(self.config.tiers) else "",
            str(tier.options.get("root_dir") or ""), str(tier.options.get("fingerprint") or ""), source)))
            for i, tier in enumerate(self.config.tiers)]

    # --- metrics
    def get_stats(self):
        """This engine's counters (deltas, labelled with the first tier: blocks loaded from and
        stored into the host region, failed jobs, lookups missed because the owner did not
        answer; with a store threshold, vLLM's `stores_skipped`: this engine's offers the owner's
        threshold skipped), the owner's gauges per tier, and the sessions' retention
        (`vllm:kvtier_retention_*`: `EngineHints.report`); the owner is asked at most every `OWNER_STATS_S`."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        first = self.config.tiers[0].name
        for name, metric in ENGINE_COUNTERS.items():
            delta = self.counters[name] - self._last[name]
            if delta:
                stats.increase_counter(METRIC_PREFIX + metric, delta, (first,))
        if self.config.store_threshold >= 2:  # as vLLM: reported (0 included) only with a threshold
            stats.increase_counter(STORES_SKIPPED, self.counters["skipped"] - self._last["skipped"])
        self._last = Counter(self.counters)
        owner = self._owner()
        for tier, values in (owner.get("tiers") or {}).items():
            capacity, resident = values.get("capacity_blocks") or 0, values.get("resident_blocks", 0)
            for gauge, value in (("resident_blocks", resident), ("capacity_blocks", capacity),
                                 ("retained_blocks", values.get("retained_blocks", 0)),
                                 ("ended_blocks", values.get("ended_blocks", 0)),
                                 ("usage_perc", resident / capacity if capacity else 0.0)):
                stats.set_gauge(METRIC_PREFIX + gauge, value, (tier,))
        return record_retention(stats, self.hints.report(owner), self._last_retention)

    def _owner(self) -> dict[str, Any]:
        """The owner's `stats` answer (`tiers`: its per-tier counters of this hierarchy, all
        engines'; `retention`: its `Retention.report()`), at most `OWNER_STATS_S` old; empty when
        it does not answer."""
        at, answer = self._owner_stats
        if time.monotonic() - at >= OWNER_STATS_S:
            answer = self._call("stats") or {}
            self._owner_stats = (time.monotonic(), answer)
        return answer

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        """The owner's per-tier counters and this engine's (`engine`: loaded, stored, failures,
        unavailable, short, skipped, host_failures, and `retention`: `EngineHints.report`); tests, bench."""
        with self._lock:
            self._owner_stats = (0.0, {})
            owner = self._owner()
            engine = {**self.counters, "host_failures": self.client.failures, "retention": self.hints.report(owner)}
            return {**(owner.get("tiers") or {}), "engine": engine}

    def shutdown(self) -> None:
        """Leave the owner (it keeps the blocks; it releases what this engine held after its grace)."""
        self.client.close()


def open_host_manager(spec: Any) -> HostOffloadingManager:
    """The manager of a `shared: host` engine (`KVTierOffloadingSpec.get_manager`): joins the
    owner's hierarchy for the spec's identity with the YAML's tiers. `HostRefused` when the owner
    refuses them (another engine of this model runs other tiers: fix the YAML); an owner not
    running now is not an error: misses until it is. The store threshold sent is the engine's
    (`kv_connector_extra_config.store_threshold` wins over the YAML's); the owner counts offers
    host-wide in a table of the default `max_tracker_size`."""
    from kvtier.integrations.vllm.spec import store_threshold_setting

    config = dataclasses.replace(spec.hierarchy_config,
                                 store_threshold=store_threshold_setting(spec.extra_config, spec.hierarchy_config,
                                                                         spec.own_extra_keys))
    identity = {"model": spec.fingerprint(), "block_bytes": spec.block_bytes, "block_tokens": spec.block_tokens}
    return HostOffloadingManager(join(config.shared, identity, config_mapping(config)), config)
