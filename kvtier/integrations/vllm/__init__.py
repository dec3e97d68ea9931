"""kvtier as a vLLM offloading backend: `KVTierOffloadingSpec` for vLLM's `OffloadingConnector`.

This package is the only part of kvtier that imports vLLM; nothing else in kvtier imports it.
Load it with::

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
  Each rank's worker copies only its own range (`KVLayout` slot offset and length); vLLM's
  connector completes a job for the scheduler only once every rank reported it. Tensor
  parallelism is supported; pipeline (and prefill context) parallelism is refused at start
  (NotImplementedError): the stages' parts would not be of one size.

vLLM's manager semantics: a request's accesses are applied once, when it finishes, in its
head-to-tail order, one prefix per KV-cache group (`kvtier.control.request_access`); `store_threshold` and
`max_tracker_size` of `kv_connector_extra_config` (or the YAML's `store_threshold`) keep blocks
offered fewer times out of the CPU tier (`kvtier.control.store_threshold`), as vLLM's CPU spec does.

Process model. The spec is built in every vLLM process that needs it; this module does no heavy
work at import or in `__init__`.

* Scheduler side (`get_manager`): the whole kvtier hierarchy is built here (`build_hierarchy`
  without KV caches). The CPU tier is a `/dev/shm` region (`kvtier.tiers.cpu.CPUBackend`) named
  after vLLM's `engine_id`; CPU<->FILE cascade and promotion jobs run on the kvtier handlers'
  thread pools, so no manager call ever waits for I/O. A hit in a lower tier is *staged*: it is
  promoted into the CPU tier while `lookup` answers RETRY, then loaded from CPU; a block that
  fails verification during promotion is dropped and reported as a MISS (vLLM recomputes it) -
  the GPU never sees it. Except for file tiers under `KVTierOffloadingConnector`
  (`spec.DirectFileLoads`, docs/vllm.md): there a file block is a HIT that each worker process
  reads itself, read-only, and verifies (its own part of the block under tensor parallelism:
  `file_loads`); a block that fails verification fails the load, which vLLM recomputes, and the
  failed load drops it (the scheduler side alone changes the tier).
* Worker side (`get_worker`): attaches the same CPU region (lazily, at the first transfer: vLLM
  registers the KV caches before the scheduler exists) and copies GPU<->CPU. It maps only the
  region whose token the scheduler sends with each CPU spec, then removes the region's name from
  /dev/shm: from then on no stop or kill of the engine can leave the region behind. With vLLM's
  default executor for one worker the worker lives in the scheduler's process and maps the region
  through the creator's descriptor, so the name is removed as soon as the region exists. The
  name stays the engine's all the same (the region's claim, see `kvtier.tiers.cpu`): a second
  engine with the same `engine_id` or `shm_name` is refused at start.

Compatible with vLLM 0.32 and 0.33; implements 0.33's additions (`lock`, `on_reset_flushed`, `config_info`,
`config_info_keys`; `submit_load(..., expedited=)`, run on the worker's expedited lane: see `worker`)
without requiring them: see `manager`.

Modules: `spec` (`KVTierOffloadingSpec`, what vLLM loads), `config` (the YAML under vLLM),
`manager` (scheduler side, with the metrics), `worker` (worker side: the worker planes over the
attached CPU region), `file_loads` (the worker's direct file loads over read-only readers of the
file tiers), `translate` (the specs both sides exchange, media names), `host_manager` and
`host_worker` (`shared: host` in the YAML: the engine uses the host owner's hierarchy, `kvtier serve`,
instead of tiers of its own). Every public
name of those is re-exported here: import them from `kvtier.integrations.vllm`. One module is not
imported here, because it loads vLLM's whole connector: `connector` (`KVTierOffloadingConnector`,
vLLM's offloading connector with failed loads and stores reported instead of asserted; selected
with `kv_connector_module_path`, see docs/vllm.md).
"""

from kvtier.integrations.vllm.config import load_raw_config, vllm_hierarchy_config
from kvtier.integrations.vllm.file_loads import FileLoads
from kvtier.integrations.vllm.manager import KVTIER_COUNTERS, KVTIER_GAUGES, METRIC_PREFIX, KVTierOffloadingManager  # noqa: F401
from kvtier.integrations.vllm.spec import DirectFileLoads, KVTierOffloadingSpec
from kvtier.integrations.vllm.translate import (
    KVTierCompositeLoadStoreSpec,
    KVTierCPULoadStoreSpec,
    KVTierFileLoadStoreSpec,
    KVTierHostLoadStoreSpec,
    to_vllm_medium,
)
from kvtier.integrations.vllm.worker import KVTierOffloadingWorker

__all__ = ["DirectFileLoads", "FileLoads", "KVTierCPULoadStoreSpec", "KVTierCompositeLoadStoreSpec",
           "KVTierFileLoadStoreSpec", "KVTierHostLoadStoreSpec", "KVTierOffloadingManager", "KVTierOffloadingSpec",
           "KVTierOffloadingWorker", "METRIC_PREFIX", "load_raw_config", "to_vllm_medium", "vllm_hierarchy_config"]
