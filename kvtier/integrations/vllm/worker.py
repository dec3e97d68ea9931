"""Worker side: vLLM's `OffloadingWorker`, copying between the KV caches and the shared CPU region,
and loading file-tier blocks itself, read-only, where the scheduler side lets it (`DirectFileLoads`;
`file_loads`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, OffloadingWorker, TransferResult

from kvtier.core import specs as kspecs
from kvtier.integrations.vllm.file_loads import FileLoads
from kvtier.integrations.vllm.translate import (
    KVTierHostLoadStoreSpec,
    file_identities,
    to_kvtier_cpu_spec,
    to_kvtier_load_spec,
)
from kvtier.tiers.cpu import RegionError
from kvtier.tiers.file.spec import FileLoadStoreSpec

if TYPE_CHECKING:
    from kvtier.integrations.vllm.host_worker import HostRegionPlanes
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec
    from kvtier.tiers.cpu import CPUBackend
    from kvtier.transfer.planes import WorkerPlane

log = logging.getLogger(__name__)
# shm_names of the CPU regions whose (only) worker lives in this process: vLLM's default executor
# for one worker ("uni") runs it in the scheduler's process, where it maps the region without a name.
_LOCAL_WORKER_REGIONS: set[str] = set()


def file_keys_by_position(source: Any) -> dict[int, bytes]:
    """The keys of a load's file blocks by their position in the load (a `FileLoadStoreSpec`, or
    the file parts of a `StagedLoadSpec`)."""
    if isinstance(source, FileLoadStoreSpec):
        return dict(enumerate(map(bytes, source.keys)))
    if isinstance(source, kspecs.CPULoadStoreSpec):
        return {}
    return {p: bytes(key) for spec, positions in getattr(source, "parts", ())
            if isinstance(spec, FileLoadStoreSpec) for p, key in zip(positions, spec.keys)}


def _failure(result: Any, keys: dict[int, bytes]) -> tuple[list[bytes] | None, int]:
    """`take_failure`'s answer for the failed kvtier `result` of a load whose file blocks are `keys`."""
    failed = list(result.failed_blocks)
    if not failed or any(p not in keys for p in failed):
        return None, 0
    return [keys[p] for p in failed], min(failed)


class KVTierOffloadingWorker(OffloadingWorker):
    """vLLM `OffloadingWorker` for kvtier: GPU <-> the kvtier CPU tier, in the worker process.

    The CPU region is attached at the first transfer (the scheduler-side manager creates it,
    after vLLM has registered the KV caches): only the region whose token the scheduler sent with
    the transfer's CPU spec, so a worker never maps another engine's region (a mismatch raises
    `RegionError`). With one worker, once mapped, the region's name is removed from /dev/shm: no
    stop, kill or crash can leave the region behind after that. With several (tensor parallel
    ranks, each in its own process) the name stays while the engine runs, since a rank cannot know
    that the others have mapped it too; the scheduler removes it at close or exit, and a crashed
    engine's region is swept at the next start (its claim's owner is dead). Copies run on
    the worker plane built over that region by `kvtier.transfer.planes.build_worker_plane`, the builder a
    standalone hierarchy uses too: kvtier's GPU<->CPU handlers (`kvtier.transfer.handlers.gpu_cpu`:
    synchronous batched index copies on CPU tensors, a copy stream on CUDA) over this rank's part
    of each slot: rank `r` of `world_size` copies bytes `[r * rank_bytes, (r + 1) * rank_bytes)`
    of every slot and never touches the others' (the scheduler side and the file tier move whole
    slots). A failed copy is reported as `success=False`, never as wrong bytes; vLLM 0.32's own
    connector asserts that every transfer succeeded, so there such a report stops the engine;
    under `KVTierOffloadingConnector` (`kvtier.integrations.vllm.connector`) a failed load is
    reported to vLLM, which recomputes it (`kv_load_failure_policy: recompute`), and a failed
    store is never made readable.

    Completion across ranks is vLLM's: each rank reports its own jobs; the connector's scheduler
    side sums the reports of all ranks (`OffloadingWorkerMetadata.aggregate`, `pending_count` =
    world size) and calls the manager's `complete_store` only when every rank has reported, so a
    block with a missing rank's part is never made readable.

    Expedited loads (vLLM 0.33's `submit_load(..., expedited=True)`: a load the engine waits for
    within the step, because its request already runs) go to a second worker plane over the same
    region and KV caches, the expedited lane, as 0.33's own CPU worker gives them a handler of
    their own: their own copy threads and (on CUDA) their own stream, so an expedited load never
    queues behind regular loads, nor behind stores (those run on the first plane's GPU->CPU
    handler). Submitting never waits for another job's copy. `get_finished` and `wait` cover both
    planes; job ids are vLLM's, unique across them. vLLM 0.32 never passes the keyword: there
    every load runs on the first plane, as before.

    Direct file loads (`kvtier.integrations.vllm.spec.DirectFileLoads`: under
    `KVTierOffloadingConnector`, whatever the executor and the number of ranks): a load whose source
    names file-tier slots (`KVTierFileLoadStoreSpec`, or a `KVTierCompositeLoadStoreSpec` of CPU and
    file slots) goes to `FileLoads` (expedited ones too), which reads this rank's part of each slot
    through read-only `SlabReader`s opened at the first such load from this worker's own config
    (`kvtier.integrations.vllm.file_loads`). Where they cannot be opened (the error is logged) such
    a load fails (no handler for it), never loads wrong bytes.

    Shared host hierarchy (`shared: host`, `kvtier.integrations.vllm.host_manager`): the specs are
    `KVTierHostLoadStoreSpec`s naming the host owner's region; `HostRegionPlanes`
    (`kvtier.integrations.vllm.host_worker`) maps exactly that region (a new one when the owner
    restarts) and fails a load's positions the owner did not pin. The engine has no region of its own.
    """

    def __init__(self, spec: KVTierOffloadingSpec, kv_caches: CanonicalKVCaches):
        self.spec = spec
        self.kv_caches = kv_caches
        self._backend: CPUBackend | None = None  # the attached region, set together with _planes
        # (regular, expedited lane): the worker planes, built at the first transfer
        self._planes: tuple[WorkerPlane, WorkerPlane] | None = None
        self._file_loads: FileLoads | None = None  # direct file loads, built at the first one
        self._file_error: str | None = None  # why they could not be opened (logged once per reason)
        # load job id -> the keys of its file blocks by position (a CPU block fails only with its job)
        self._loads: dict[int, dict[int, bytes]] = {}
        self._failures: dict[int, tuple[list[bytes] | None, int]] = {}  # job id -> `take_failure`'s answer
        self._tier = spec.hierarchy_config.tiers[0].name
        self._host: HostRegionPlanes | None = None  # shared: host: the owner's regions, built at the first transfer
        # vLLM's in-process executor ("uni") serves one worker only
        if spec.num_copies == 1 and spec.hierarchy_config.shared is None:
            _LOCAL_WORKER_REGIONS.add(spec.hierarchy_config.tiers[0].options["shm_name"])

    def _ready(self, cpu_spec: Any) -> tuple[WorkerPlane, WorkerPlane]:
        """The (regular, expedited lane) planes over the region `cpu_spec` names, attached at the first call."""
        token = getattr(cpu_spec, "region", None)
        if self._planes is not None:
            attached = self._backend
            assert attached is not None  # set together with _planes
            if token != attached.token:
                raise RegionError(f"kvtier worker: a transfer names CPU region token {token!r}, this worker "
                                  f"serves region {attached.shm_name} of its own scheduler (token mismatch)")
            return self._planes
        if token is None:
            raise RegionError(f"kvtier worker: the CPU spec {cpu_spec!r} carries no region token; this worker "
                              f"serves only the specs of its own kvtier scheduler")
        from kvtier.tiers.cpu import CPUBackend

        spec = self.spec
        tier = spec.hierarchy_config.tiers[0]
        n = tier.capacity.to_blocks(spec.block_bytes)
        backend = CPUBackend.attach(tier.options["shm_name"], n, spec.block_bytes, spec.block_tokens,
                                    name=tier.name, pin=tier.options.get("pin", "auto"), token=token)
        try:
            planes = self._build_planes(backend)
        except BaseException:
            backend.close()
            raise
        if spec.num_copies == 1:
            backend.unpublish()  # every process that maps the region (scheduler, this worker) has it now
        self._backend, self._planes = backend, planes
        return planes

    def _build_planes(self, region: Any) -> tuple[WorkerPlane, WorkerPlane]:
        """The regular plane and the expedited lane over `region`; a failure stops the ones built."""
        regular = self._build_plane(region)
        try:
            # (The lane's GPU->CPU handler stays idle: its threads are made only at a first job.)
            return regular, self._build_plane(region)
        except BaseException:
            regular.shutdown()
            raise

    def _build_plane(self, region: Any) -> WorkerPlane:
        """The worker plane between the KV caches and the attached CPU `region` (both directions);
        RuntimeError when the handlers cannot serve these KV caches."""
        from kvtier.transfer.planes import build_worker_plane

        plane = build_worker_plane({region.name: region}, self._rank_kv_caches())
        gpu, cpu = kspecs.GPULoadStoreSpec, kspecs.CPULoadStoreSpec
        if plane.handler_for(gpu, cpu) is None or plane.handler_for(cpu, gpu) is None:
            plane.shutdown()
            raise RuntimeError("kvtier: no GPU<->CPU handler for these KV caches")
        return plane

    def _rank_kv_caches(self) -> Any:
        """The KV caches as kvtier's handlers see them: vLLM's blocks in chunks of
        `blocks_per_chunk`, and, under tensor parallelism, this rank's part of each slot."""
        from kvtier.transfer.handlers.gpu_cpu import ChunkedKVCaches

        spec = self.spec
        part = (spec.rank * spec.rank_bytes, spec.rank_bytes) if spec.num_copies > 1 else (0, None)
        vllm_kv: Any = self.kv_caches  # vLLM's CanonicalKVCaches: the fields of kvtier's, duck-typed
        return ChunkedKVCaches(list(vllm_kv.tensors), list(vllm_kv.group_data_refs), spec.blocks_per_chunk, *part)

    @staticmethod
    def _gpu(spec: GPULoadStoreSpec) -> kspecs.GPULoadStoreSpec:
        return kspecs.GPULoadStoreSpec(spec.block_ids, spec.group_sizes, spec.block_indices)

    def _host_planes(self) -> HostRegionPlanes:
        """The host owner's regions as this worker maps them (`shared: host`), built at the first call."""
        if self._host is None:
            from kvtier.integrations.vllm.host_worker import HostRegionPlanes

            spec = self.spec
            pin = spec.hierarchy_config.tiers[0].options.get("pin", "auto")
            self._host = HostRegionPlanes(self._build_planes, spec.block_bytes, spec.block_tokens,
                                          spec.blocks_per_chunk, pin)
        return self._host

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: Any) -> bool:
        if isinstance(dst_spec, KVTierHostLoadStoreSpec):
            self._host_planes().submit_store(job_id, self._gpu(src_spec), dst_spec)
            return True
        regular, _ = self._ready(dst_spec)
        regular.submit(self._gpu(src_spec), to_kvtier_cpu_spec(dst_spec, self._tier), job_id)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        """Start a load into the KV cache: from CPU slots on the regular plane or, `expedited`
        (vLLM 0.33), on the expedited lane; one that names file slots on `FileLoads`; one from the
        host owner's region on `HostRegionPlanes` (class docstring)."""
        if isinstance(src_spec, KVTierHostLoadStoreSpec):
            self._loads[job_id] = dict(enumerate(src_spec.keys))  # (its unpinned positions fail by key)
            self._host_planes().submit_load(job_id, src_spec, self._gpu(dst_spec), expedited)
            return True
        regular, lane = self._ready(src_spec)
        source = to_kvtier_load_spec(src_spec, self._tier)
        self._loads[job_id] = file_keys_by_position(source)
        if isinstance(source, kspecs.CPULoadStoreSpec):
            (lane if expedited else regular).submit(source, self._gpu(dst_spec), job_id)
            return True
        files = self._files()
        if files is None:  # (no handler for file slots there: the job fails)
            (lane if expedited else regular).submit(source, self._gpu(dst_spec), job_id)
        else:
            files.submit(source, self._gpu(dst_spec), job_id, file_identities(src_spec))
        return True

    def _files(self) -> FileLoads | None:
        """The direct file loads, built at the first call (`FileLoads.open`: read-only readers of
        this rank's part of each file tier); None, with the reason logged (once per reason), when
        they cannot be opened now (tried again at the next file load)."""
        if self._file_loads is None:
            from kvtier.transfer.handlers.kv_layout import KVLayout

            assert self._backend is not None  # (`_ready` attached it)
            spec = self.spec
            try:
                # (a staged row is this rank's `rank_bytes` of a slot, also with one rank)
                layout = KVLayout(self._rank_kv_caches(), spec.blocks_per_chunk, spec.rank * spec.rank_bytes,
                                  spec.rank_bytes)
                self._file_loads = FileLoads.open(spec, self._backend, layout)
            except Exception as exc:  # noqa: BLE001 - the file loads fail, the worker serves on
                why = f"{type(exc).__name__}: {exc}"
                if why != self._file_error:
                    self._file_error = why
                    log.error("kvtier worker rank %d: cannot read the file tier(s) directly (%s); their loads fail "
                              "and vLLM recomputes them", spec.rank, why)
                return None
        return self._file_loads

    def _all_planes(self) -> list[Any]:
        return [*(self._planes or ()), *([self._file_loads] if self._file_loads is not None else []),
                *([self._host] if self._host is not None else [])]

    def get_finished(self) -> list[TransferResult]:
        finished = []
        for plane in self._all_planes():
            for r in plane.poll():
                keys = self._loads.pop(r.job_id, None)
                if not r.success and keys is not None:
                    self._failures[r.job_id] = _failure(r, keys)
                finished.append(TransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time))
        return finished

    def take_failure(self, job_id: int) -> tuple[list[bytes] | None, int]:
        """What failed in the load job `job_id` that `get_finished` reported failed: the keys of its
        blocks that failed (None: the job names none, e.g. an I/O error or a CPU copy: every
        block), and the position (in the load's key order) of the first failed block (0 then).
        The blocks before that position were loaded; the failed ones were not (nor are any
        after them to be trusted by the engine, which recomputes from the first failed one on)."""
        return self._failures.pop(job_id, (None, 0))

    def wait(self, job_ids: set[int]) -> None:
        for plane in self._all_planes():
            plane.wait(job_ids)

    def wait_for_file_loads(self, timeout: float) -> None:
        """The engine has nothing to compute this step: wait, at most `timeout` seconds, until a
        direct file load in flight has been read (`FileLoads.wait_any`) rather than let the engine
        spin through idle steps that hold the GIL the load's threads need (docs/vllm.md)."""
        if self._file_loads is not None:
            self._file_loads.wait_any(timeout)

    def shutdown(self) -> None:
        """Stop the planes within `SHUTDOWN_TIMEOUT_S` (copies hung in the kernel are abandoned and
        logged, the region then left mapped), then release the CPU region."""
        from kvtier.control.manager import SHUTDOWN_TIMEOUT_S

        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        abandoned: list[str] = []
        for plane in self._all_planes():
            abandoned += plane.shutdown(max(0.0, deadline - time.monotonic())).jobs
        self._planes, self._file_loads, self._host = None, None, None
        if abandoned:
            log.error("kvtier worker: shutdown abandoned %d transfer job(s) still running after %g s: %s",
                      len(abandoned), SHUTDOWN_TIMEOUT_S, "; ".join(abandoned))
            self._backend = None  # (left mapped: a copy may still use it)
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        _LOCAL_WORKER_REGIONS.discard(self.spec.hierarchy_config.tiers[0].options["shm_name"])

