"""`KVTierOffloadingSpec`: what vLLM's `OffloadingConnector` loads (see the package docstring)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)

from kvtier.config.vllm import ignored_extra_keys, read_extra_config
from kvtier.control.store_threshold import DEFAULT_MAX_TRACKER_SIZE
from kvtier.integrations.vllm.config import load_raw_config, load_vllm_config
from kvtier.integrations.vllm.file_loads import direct_file_tiers
from kvtier.integrations.vllm.logs import log_through_vllm, tier_summary
from kvtier.integrations.vllm.manager import (
    CONFIG_INFO_KEYS,
    KVTIER_COUNTERS,
    KVTIER_GAUGES,
    METRIC_PREFIX,
    KVTierOffloadingManager,
)
from kvtier.integrations.vllm.retention_metrics import retention_metric_definitions
from kvtier.integrations.vllm.vllm_metrics import vllm_metric_definitions
from kvtier.integrations.vllm.worker import _LOCAL_WORKER_REGIONS, KVTierOffloadingWorker
from kvtier.tiers.cpu import CPUBackend

log = logging.getLogger(__name__)


def _ranks(parallel: Any) -> tuple[int, int]:
    """`(world_size, rank)` of vLLM's parallel config, refusing what the per-rank layout cannot
    serve: every rank must hold the same number of KV bytes per block, which holds under tensor
    parallelism but not across pipeline stages (each holds other layers, possibly unevenly many,
    and the scheduler's per-block byte count covers all of them)."""
    world, rank = max(1, int(parallel.world_size)), int(parallel.rank)
    pp, pcp = int(getattr(parallel, "pp_size", 1)), int(getattr(parallel, "pcp_size", 1))
    if pp > 1 or pcp > 1:
        raise NotImplementedError(f"kvtier supports tensor parallelism only; this engine has pipeline_parallel_size="
                                  f"{pp}, prefill_context_parallel_size={pcp} (both must be 1)")
    if not 0 <= rank < world:
        raise ValueError(f"kvtier: worker rank {rank} is outside 0..{world - 1} (world_size {world})")
    return world, rank


def store_threshold_setting(extra_config: Mapping[str, Any], config: Any = None, own_keys: tuple[str, ...] = ()) -> int:
    """The store threshold: `extra_config`'s `store_threshold` (vLLM's name) when given, else the
    kvtier config's (`config`, or the YAML `kvtier_config` names). `extra_config` is checked first
    (`read_extra_config`, with a spec subclass's `own_keys`: a `ConfigError` names a bad value or
    an unknown key)."""
    given = read_extra_config(extra_config, own_keys)["store_threshold"]
    if given is not None:
        return int(given)
    if config is not None:
        return int(config.store_threshold)
    raw, _ = load_raw_config(extra_config.get("kvtier_config"))
    value = raw.get("store_threshold", 0) if isinstance(raw, dict) else 0
    return value if isinstance(value, int) else 0


def vllm_has_sync_loads() -> bool:
    """Whether this vLLM issues synchronous loads (0.33's `TransferJob.sync`: the request runs in
    the step that loads it), whose failure vLLM may recompute wrongly (vLLM bug #49250)."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

    return "sync" in {f.name for f in dataclasses.fields(TransferJob)}


class DirectFileLoads:
    """Whether the engine's workers load this hierarchy's file tiers themselves (scheduler side).

    Direct: `lookup` answers HIT for a readable file-tier block (no promotion, no RETRY),
    `prepare_load` pins it in the file tier and hands the workers its slots (with the keys their
    headers must carry and the tier's manifest digest), and each worker process reads this rank's
    part of each slot read-only and verifies it (`kvtier.integrations.vllm.file_loads`), whatever
    the executor ("uni", "mp") and the number of ranks. The pin holds until `complete_load`, so the
    slot is not reused while a worker reads it. A block that fails verification fails the load
    job, which only a connector that reports failed loads turns into a recompute:
    `KVTierOffloadingConnector` calls `enable` when it adopts the manager; vLLM's own connector
    never does (it stops the engine on a failed job), so its file blocks stay promoted into the
    CPU tier and verified on the scheduler side. Also promoted: with `direct_file_loads: false`,
    and, unless `direct_file_loads: true`, on a vLLM with synchronous loads (0.33; vLLM bug #49250)."""

    def __init__(self, hierarchy: Any, ranks: int, reason: str | None):
        self.manager = hierarchy.manager
        self.ranks = ranks
        self.reason = reason  # why the loads are promoted whatever the connector; None: direct once enabled
        tiers = self.manager.tiers
        self.files = {tiers[i].name: tiers[i].backend for i in direct_file_tiers(hierarchy.config)}
        self.enabled = False
        self._told = False  # the one log line saying which path the file tiers take (`_tell`)
        if reason is not None:  # decided now, whatever the connector
            self._tell(f"promoted into the CPU tier and verified there ({reason})")

    def _tell(self, path: str) -> None:
        """Log, once per engine, which path the file tiers take."""
        if self.files and not self._told:
            self._told = True
            log.info("kvtier: file tier(s) %s: %s", ", ".join(self.files), path)

    def settle(self) -> None:
        """The engine's first request (`KVTierOffloadingManager.on_new_request`): the connector has
        had its say by then (`enable` is called while it is built), so an engine whose file tiers
        were neither enabled nor promoted for a reason runs vLLM's own connector: say so, once."""
        self._tell("promoted into the CPU tier and verified there (the connector does not report failed loads: "
                   "vLLM's OffloadingConnector stops the engine on one; KVTierOffloadingConnector loads them "
                   "directly)")

    def enable(self) -> bool:
        """The connector reports failed loads to vLLM: load the file tiers directly where allowed
        (the class docstring). Returns whether they are; logs which path is in use."""
        if self.enabled or not self.files or self.reason is not None:
            return self.enabled
        for tier in self.manager.tiers[1:]:
            if tier.name in self.files:
                tier.direct_load = True
        self.enabled = True
        if vllm_has_sync_loads():
            log.warning("kvtier: direct_file_loads: true on a vLLM with synchronous loads: a failed one may be "
                        "recomputed wrongly (vLLM bug #49250)")
        each = "the worker" if self.ranks == 1 else f"each of the {self.ranks} tensor-parallel ranks"
        self._tell(f"loaded by the worker directly and verified there ({each} opens them read-only in its own "
                   f"process and verifies the bytes it reads; a block that fails verification fails its load, "
                   f"which vLLM recomputes)")
        return True


def _direct_reason(spec: Any) -> str | None:
    """Why file tiers cannot be loaded directly by this engine's workers (None: they can). Not
    given, `direct_file_loads` is off where vLLM has synchronous loads (`vllm_has_sync_loads`)."""
    option = spec.extra_options["direct_file_loads"]  # (checked by read_extra_config: True, False, or None)
    if option is False:
        return "direct_file_loads: false"
    if option is None and vllm_has_sync_loads():
        return ("this vLLM has synchronous loads, whose failure it may recompute wrongly (vLLM bug #49250); "
                "direct_file_loads: true loads directly all the same")
    return None


class KVTierOffloadingSpec(OffloadingSpec):
    """vLLM `OffloadingSpec` whose manager and worker are kvtier's (see the module docstring).

    `kv_connector_extra_config` keys: `kvtier_config` (YAML path or mapping; default: kvtier's
    `configs/cpu-file.yaml`) plus vLLM's own (`block_size` / `blocks_per_chunk`, ...; and, as for
    vLLM's CPU spec, `store_threshold` and `max_tracker_size`: `kvtier.control.store_threshold`).
    Any other key, and a bad value, is refused at start (`kvtier.config.vllm.read_extra_config`),
    but those a subclass names in `own_extra_keys` (the keys it reads itself).
    """

    own_extra_keys: tuple[str, ...] = ()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {}
        for name, doc in KVTIER_COUNTERS.items():
            defs[METRIC_PREFIX + name] = OffloadingCounterMetadata(documentation=f"kvtier: {doc}",
                                                                   labelnames=("tier",))
        for name, doc in KVTIER_GAUGES.items():
            defs[METRIC_PREFIX + name] = OffloadingGaugeMetadata(documentation=f"kvtier: {doc}",
                                                                 labelnames=("tier",))
        threshold = store_threshold_setting(extra_config, own_keys=cls.own_extra_keys)
        return {**defs, **retention_metric_definitions(), **vllm_metric_definitions(stores_skipped=threshold >= 2)}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33: the labels of `vllm:kv_offload_config_info` that the manager's
        `config_info` fills (one series per tier)."""
        return CONFIG_INFO_KEYS

    def __init__(self, config):
        log_through_vllm()  # so that what follows (and the tier summary) reaches the server's log
        super().__init__(config)
        # Refused here, in every process, before anything is built: a bad value, an unknown key.
        self.extra_options = read_extra_config(self.extra_config, self.own_extra_keys)
        self.replicated_layout = False
        tokens = set(self.tokens_per_block)
        if len(tokens) != 1:
            raise ValueError(f"kvtier needs one block size across KV groups, vLLM has {self.tokens_per_block}")
        self.block_tokens = tokens.pop() * self.blocks_per_chunk
        self.num_copies, self.rank = _ranks(config.parallel)
        self.rank_bytes = int(config.worker_kv_bytes_per_block) * self.blocks_per_chunk
        self.block_bytes = self.rank_bytes * self.num_copies
        self.hierarchy_config = load_vllm_config(self.extra_options["kvtier_config"],
                                                 block_tokens=self.block_tokens, engine_id=str(config.engine_id),
                                                 fingerprint=self.fingerprint(), ranks=self.num_copies)
        self._manager: KVTierOffloadingManager | None = None
        self._host_manager: OffloadingManager | None = None  # shared: host (`host_manager`)
        self._worker: KVTierOffloadingWorker | None = None

    def fingerprint(self) -> str:
        """Identity of the bytes this engine offloads: the model as vLLM names it (`--model`: a hub
        id or a local path), KV dtype, page arrangement and block geometry. vLLM passes no
        revision: to keep two revisions or fine-tunes served under one name apart, set the file
        tier's `fingerprint` in the YAML (e.g. to the revision); it is added to this."""
        config = self.config
        model = getattr(config, "model", None)
        # How a page's bytes are arranged (NHD/HND, canonical or not): same size, other bytes.
        arrangement = (f"{getattr(config, 'kv_cache_layout', None) or 'default'}"
                       f"{'/canonical' if getattr(config, 'canonical_layout', False) else ''}")
        return (f"vllm:model={getattr(model, 'name', '?')}:dtype={getattr(model, 'dtype', '?')}"
                f":kv_layout={arrangement}:tokens={self.block_tokens}:rank_bytes={self.rank_bytes}"
                f":ranks={self.num_copies}")

    def get_manager(self) -> OffloadingManager:
        if self.hierarchy_config.shared is not None:  # shared: host: the host owner's tiers, none of its own
            if self._host_manager is None:
                from kvtier.integrations.vllm.host_manager import open_host_manager

                self._host_manager = open_host_manager(self)
            return self._host_manager
        if self._manager is None:
            if self.block_bytes <= 0:
                raise ValueError("kvtier: vLLM reported no KV bytes per block; cannot size the tiers")
            from kvtier.control.hierarchy import build_hierarchy

            enable_events = bool(self.kv_events_config.enable_kv_cache_events)
            # Creating the CPU region first sweeps the regions and claims of dead owners (any name),
            # reclaims this name if its owner is dead, and refuses it (RegionInUseError, with the
            # owner's pid) if another engine holds its claim, even once that engine's region name is gone.
            hierarchy = build_hierarchy(self.hierarchy_config, block_bytes=self.block_bytes, kv_caches=None,
                                        enable_events=enable_events)
            region = hierarchy.first_backend
            assert isinstance(region, CPUBackend)  # vllm_hierarchy_config puts a cpu tier first
            local = region.shm_name in _LOCAL_WORKER_REGIONS
            if local:
                region.unpublish()  # the engine's worker runs in this process: it maps the region without a name
            threshold = store_threshold_setting(self.extra_config, self.hierarchy_config, self.own_extra_keys)
            tracker = self.extra_options["max_tracker_size"] or DEFAULT_MAX_TRACKER_SIZE
            try:
                self._manager = KVTierOffloadingManager(hierarchy, enable_events, store_threshold=threshold,
                                                        max_tracker_size=tracker)
            except BaseException:
                hierarchy.close()  # (its tiers would stay open, and a root_dir held, in this process)
                raise
            ignored = ignored_extra_keys(self.extra_config)
            if ignored:
                log.warning("kvtier: kv_connector_extra_config %s ignored: keys of vLLM's own offloading specs; "
                            "KVTierOffloadingSpec's tiers, capacities and policies come from kvtier_config",
                            ", ".join(ignored))
            self._manager.direct_file_loads = DirectFileLoads(hierarchy, self.num_copies, _direct_reason(self))
            log.info("%s", tier_summary(hierarchy, self.block_tokens, self.block_bytes))
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KVTierOffloadingWorker(self, kv_caches)
        return self._worker

    def shutdown(self) -> None:
        """Shut down the worker and then the manager that `get_worker` and `get_manager` built (vLLM
        shuts down what it got itself; this is for code that drives a spec directly). Idempotent: a
        later `get_*` call builds a new one."""
        worker, manager, self._worker, self._manager = self._worker, self._manager, None, None
        host, self._host_manager = self._host_manager, None
        if worker is not None:
            worker.shutdown()
        for each in (manager, host):
            if each is not None:
                each.shutdown()
