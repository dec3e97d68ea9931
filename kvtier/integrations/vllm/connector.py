"""`KVTierOffloadingConnector`: vLLM's `OffloadingConnector`, with failed transfers reported to
vLLM instead of asserted away. Select it with::

    --kv-transfer-config '{"kv_connector": "KVTierOffloadingConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm", "kvtier_config": "configs/vllm-cpu-file.yaml"}}'

vLLM 0.32's connector asserts that every transfer job succeeded, so one failed job stops the
engine. This connector keeps everything else of vLLM's (scheduling, job ids, store fencing,
metrics) and changes what a failed job does:

* A failed LOAD is still reported as finished receiving (the request must leave its wait), and
  the engine blocks it was to fill are reported as load errors: with one KV-cache group as
  `get_block_ids_with_load_errors()` (vLLM recomputes from the first failed block on, keeping the
  valid prefix); with several groups, where vLLM 0.32 refuses block ids (its block ids are unique
  only within a group), as `failed_recving` (the whole request is recomputed). With
  `kv_load_failure_policy: "recompute"` vLLM recomputes those tokens; with vLLM's default
  (`"fail"`) vLLM ends the request with an error. On the scheduler side
  the failed load's blocks are unpinned and dropped from kvtier's first tier
  (`KVTierOffloadingManager.complete_failed_load`; from a file tier, for a file block the
  worker loaded directly), so the recompute's own lookup does not load them again.
* Direct file loads: with kvtier's spec, this connector lets the worker load file-tier blocks
  itself and verify them there (`kvtier.integrations.vllm.spec.DirectFileLoads`, where allowed):
  a block that fails verification fails its load job, which is reported as above (and the
  file-tier blocks it read are dropped). Under vLLM's own connector they are promoted instead.
* A failed STORE never becomes readable: the job is still completed (so the engine's store
  fences and the request's bookkeeping are released), but kvtier's manager is told
  `complete_store(..., success=False)`, which frees the slots.

Idle steps: while every request waits for its KV (a reload in flight, or a lookup deferred until
it lands), vLLM's engine still steps, with nothing to compute, as fast as it can. In one process
those steps hold the GIL that a direct file load's threads need between their system calls. The
scheduler side marks such a step (`engine_idle` in its metadata: no token scheduled), and there
the worker side waits for a direct file load in flight to be read, at most `IDLE_WAIT_S`, before
it collects finished jobs: the load runs unhindered and is reported in the same step. A step that
computes never waits; a request arriving meanwhile waits at most `IDLE_WAIT_S` to be scheduled.

How the failure travels: the worker side marks the job completed as usual and lists it in
`KVTierWorkerMetadata.failed_jobs` (summed over workers like `completed_jobs`); the scheduler side
marks the job's keys as `FailedKeys` before vLLM's own completion code runs, and the manager
wrapper (`_FailureAwareManager`) turns a completion of `FailedKeys` into the failure calls above.
Under tensor parallelism a job that failed on any rank is a failed job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.02  # at most this long an idle step waits for a direct file load (module docstring)

__all__ = ["FailedKeys", "KVTierOffloadingConnector", "KVTierWorkerMetadata"]


class FailedKeys(set):
    """The keys of a transfer job that failed on at least one worker (a marker type: the job's
    key set is replaced by one of these before vLLM completes the job); `bad`: those that failed
    (None: every one)."""

    bad: set[bytes] | None = None


def merge_failures(a: list[bytes] | None, b: list[bytes] | None) -> list[bytes] | None:
    """The keys that failed in one job on either of two workers (None: every key, on either)."""
    return None if a is None or b is None else sorted(set(a) | set(b))


@dataclass
class KVTierWorkerMetadata(OffloadingWorkerMetadata):
    """`OffloadingWorkerMetadata` plus `failed_jobs` ({job_id: the keys of its blocks that failed,
    or None for every block}), merged over workers: under tensor parallelism a block that failed
    on any rank failed.

    A failed job is in `completed_jobs` too: vLLM counts it done once every worker reported it."""

    failed_jobs: dict[int, list[bytes] | None] = field(default_factory=dict)

    def aggregate(self, other: Any) -> KVTierWorkerMetadata:
        merged = cast(OffloadingWorkerMetadata, super().aggregate(other))
        failed = dict(self.failed_jobs)
        for job_id, bad in (getattr(other, "failed_jobs", None) or {}).items():
            failed[job_id] = merge_failures(failed[job_id], bad) if job_id in failed else bad
        return KVTierWorkerMetadata(merged.completed_jobs, merged.transfer_stats, failed)


class _FailureAwareManager:
    """The scheduler side's `OffloadingManager`, with completions of `FailedKeys` turned into
    failures: `complete_store(success=False)`, and `complete_failed_load` where the manager has it
    (kvtier's does; any other manager gets its plain `complete_load`). Everything else is the
    wrapped manager's, unchanged."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
        self._inner.complete_store(keys, req_context, success=success and not isinstance(keys, FailedKeys))

    def complete_load(self, keys: Any, req_context: Any) -> None:
        failed_load = getattr(self._inner, "complete_failed_load", None)
        if isinstance(keys, FailedKeys) and failed_load is not None:
            failed_load(keys, req_context, keys.bad)
        else:
            self._inner.complete_load(keys, req_context)


def _require(side: Any, names: tuple[str, ...]) -> None:
    """Refuse to start (RuntimeError) when vLLM's connector side lacks a field this connector
    relies on: a vLLM that renamed it would otherwise make failed stores readable."""
    missing = [name for name in names if not hasattr(side, name)]
    if missing:
        raise RuntimeError(f"KVTierOffloadingConnector: this vLLM's {type(side).__name__} has no "
                           f"{', '.join(missing)}; it supports vLLM 0.32 and 0.33's offloading connector "
                           f"(use kv_connector 'OffloadingConnector' with this vLLM)")


class _Scheduler(OffloadingConnectorScheduler):
    """vLLM's scheduler side; failed jobs reach the manager as failures (see the module docstring)."""

    _REQUIRED = ("manager", "_jobs", "_stale_job_threshold", "_req_status")

    def _adopt(self) -> None:
        _require(self, self._REQUIRED)
        direct = getattr(self.manager, "direct_file_loads", None)
        if direct is not None:  # kvtier's manager: failed loads are recomputed, so file tiers may be loaded directly
            direct.enable()
        self.manager = cast(Any, _FailureAwareManager(self.manager))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        for job_id, bad in (getattr(meta, "failed_jobs", None) or {}).items():
            job = self._jobs.get(job_id)
            if job is None or job_id < self._stale_job_threshold:
                continue  # a job of before a cache reset: vLLM skips its completion too
            if not isinstance(job.keys, FailedKeys):
                kind = "store" if job.is_store else "load"
                log.warning("kvtier: %s job %d of request %s failed on a worker (%s of %d blocks)", kind, job_id,
                            job.req_id, "all" if bad is None else len(bad), len(job.keys))
                job.keys = FailedKeys(job.keys)
                job.keys.bad = None if bad is None else set(bad)
            else:  # (another worker's report of the same job, in a later step)
                job.keys.bad = None if bad is None or job.keys.bad is None else job.keys.bad | set(bad)
            if not job.is_store:
                self._store_again(job.req_id, job.keys.bad if job.keys.bad is not None else job.keys)
        super().update_connector_output(connector_output)

    def _store_again(self, req_id: str, recomputed: set) -> None:
        """The blocks of a failed load are recomputed by vLLM from the first failed one on: let the
        request store them again (vLLM's scheduler moved its next block to store past the load)."""
        status = self._req_status.get(req_id)
        for group in getattr(status, "group_states", ()):
            at = [i for i, key in enumerate(group.offload_keys) if key in recomputed]
            if at and hasattr(group, "next_stored_chunk_idx"):
                group.next_stored_chunk_idx = min(group.next_stored_chunk_idx, at[0])


class _Worker(OffloadingConnectorWorker):
    """vLLM's worker side, reporting failed jobs instead of asserting that none failed."""

    _REQUIRED = ("worker", "_load_jobs", "_connector_worker_meta")

    def _adopt(self, block_level: bool) -> None:
        _require(self, self._REQUIRED)
        self._block_level = block_level  # one KV-cache group: report engine block ids
        self._load_blocks: dict[int, Any] = {}  # load job id -> its engine (GPU) spec: the blocks it fills
        self._failed_jobs: dict[int, list[bytes] | None] = {}  # since the last worker metadata: job -> keys failed
        self._failed_blocks: set[int] = set()  # since the last get_block_ids_with_load_errors
        self._failed_requests: set[str] = set()  # since the last get_transfer_results

    def start_kv_transfers(self, metadata: Any) -> None:
        for job_id, entry in metadata.load_jobs.items():
            self._load_blocks[job_id] = entry.dst_spec
        super().start_kv_transfers(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """As vLLM's, except that a failed job is completed and recorded as failed (a load's
        request is still finished receiving); a failed job's bytes are not counted as moved."""
        assert self.worker is not None
        finished_recving: set[str] = set()
        meta = self._connector_worker_meta
        for result in self.worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs  # (a sync load of vLLM 0.33 is there with no request)
            req_id = self._load_jobs.pop(job_id, None)
            blocks = self._load_blocks.pop(job_id, None)
            if result.success:
                if result.transfer_time is not None and result.transfer_size is not None:
                    stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                    stats.record(result.transfer_size, result.transfer_time)
            else:
                self._record_failure(job_id, is_load, req_id, blocks)
            meta.mark_completed(job_id)
            if req_id is not None:
                finished_recving.add(req_id)
        return set(), finished_recving

    def _record_failure(self, job_id: int, is_load: bool, req_id: str | None, gpu: Any) -> None:
        """Record a failed job for the metadata (with the keys that failed, for a load whose worker
        names them: kvtier's `take_failure`) and, for a load, for vLLM's load-error calls: with
        one KV-cache group the engine blocks from the first failed key's on (the blocks before it
        were loaded: vLLM keeps that prefix). A failed sync load (vLLM 0.33: its request runs this
        step, `req_id` None) is reported by its blocks, which vLLM handles for running requests
        too; with several KV-cache groups vLLM takes only failed requests that wait for KV, so
        there it raises: the step must not run on blocks that were never loaded."""
        take = getattr(self.worker, "take_failure", None)
        bad, first = take(job_id) if is_load and take is not None else (None, 0)
        self._failed_jobs[job_id] = bad
        if not is_load:
            log.warning("kvtier: store job %d failed; its blocks are not made readable", job_id)
            return
        per_chunk = getattr(getattr(self, "spec", None), "blocks_per_chunk", None)
        start = engine_offset(gpu, first, per_chunk) if gpu is not None and per_chunk else 0  # (else: all)
        blocks = [] if gpu is None else list(gpu.block_ids)[start:]
        log.warning("kvtier: load job %d of request %s failed (%s blocks failed, %d engine blocks reported); "
                    "vLLM's kv_load_failure_policy decides what follows", job_id, req_id or "(sync)",
                    "all" if bad is None else len(bad), len(blocks))
        if self._block_level:
            self._failed_blocks.update(blocks)
        elif req_id is not None:
            self._failed_requests.add(req_id)
        else:
            raise RuntimeError(f"kvtier: sync load job {job_id} failed with several KV-cache groups; vLLM "
                               f"cannot be told which running request's blocks are invalid, so the engine "
                               f"stops rather than compute on blocks that were never loaded")

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_failed_requests(self) -> set[str]:
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        if meta is None:  # (a failed job is a completed one: nothing failed either)
            return None
        failed, self._failed_jobs = self._failed_jobs, {}
        return KVTierWorkerMetadata(meta.completed_jobs, meta.transfer_stats, failed)


def engine_offset(gpu: Any, position: int, blocks_per_chunk: int) -> int:
    """The index, among the engine blocks of a one-group load `gpu` (a `GPULoadStoreSpec`), of the
    first block of the load's key at `position`: its first key may cover only the last sub-blocks
    of its chunk (`block_indices[0] % blocks_per_chunk` are skipped)."""
    indices = getattr(gpu, "block_indices", None)
    skip = int(indices[0]) % blocks_per_chunk if indices is not None and len(indices) else 0
    return max(0, position * blocks_per_chunk - skip)


class KVTierOffloadingConnector(OffloadingConnector):
    """vLLM's `OffloadingConnector` whose failed transfers are reported, not asserted (see the
    module docstring). Works with any offloading spec; kvtier's manager also drops a failed
    load's blocks so they are not loaded again."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        # vLLM's constructor builds its own scheduler or worker side; they become ours in place
        # (building them again would build the spec's manager, and kvtier's CPU region, twice).
        if self.connector_scheduler is not None:
            self.connector_scheduler.__class__ = _Scheduler
            cast(_Scheduler, self.connector_scheduler)._adopt()
        if self.connector_worker is not None:
            self.connector_worker.__class__ = _Worker
            cast(_Worker, self.connector_worker)._adopt(len(kv_cache_config.kv_cache_groups) <= 1)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta: Any = super().build_connector_meta(scheduler_output)
        meta.engine_idle = scheduler_output.total_num_scheduled_tokens == 0  # (module docstring, "Idle steps")
        return meta

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        idle = getattr(getattr(self, "_connector_metadata", None), "engine_idle", False)  # (this step's)
        if idle and isinstance(self.connector_worker, _Worker):
            wait = getattr(self.connector_worker.worker, "wait_for_file_loads", None)  # (kvtier's worker)
            if wait is not None:
                wait(IDLE_WAIT_S)
        results = super().get_transfer_results(finished_req_ids)
        if isinstance(self.connector_worker, _Worker):
            results.failed_recving |= self.connector_worker.take_failed_requests()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        if isinstance(self.connector_worker, _Worker):
            return self.connector_worker.take_failed_blocks()
        return set()
