"""Worker side of `shared: host`: copies between the KV caches and the host owner's CPU region.

`HostRegionPlanes` maps the region a `KVTierHostLoadStoreSpec` names (shm_name, size and token:
`CPUBackend.attach` refuses a region whose token differs, so a worker never maps another region
under the same name) and copies over worker planes built on it, as `KVTierOffloadingWorker` does
over its engine's own region. A spec naming another token (the owner restarted: its new region
has a new token) maps the new region; the old one's planes are retired: their jobs in flight
still finish and are reported, then the planes stop and the old region is unmapped.

A load whose spec pins fewer keys than it loads (the owner could not pin the rest: another engine
evicted them since the lookup, or the owner did not answer) fails the positions not pinned, never
reading their slots: with one KV-cache group the pinned prefix is copied and the job then fails
from the first unpinned position on (vLLM keeps the loaded prefix and recomputes the rest); with
several groups nothing is copied: `KVTierOffloadingConnector` then reports the whole request
failed (vLLM recomputes all of it), whatever position the failure names. The failed positions are
the job's `failed_blocks`, so `take_failure` names exactly the keys not pinned (the scheduler side
keeps the pinned ones: they were not at fault).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.core import specs as kspecs
from kvtier.core.types import TransferResult
from kvtier.transfer.router import Abandoned

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from kvtier.integrations.vllm.translate import KVTierHostLoadStoreSpec
    from kvtier.tiers.cpu import CPUBackend
    from kvtier.transfer.planes import WorkerPlane

log = logging.getLogger(__name__)


@dataclass
class _Region:
    """One mapped owner region, its (regular, expedited lane) planes and its jobs in flight."""

    backend: CPUBackend
    planes: tuple[WorkerPlane, WorkerPlane]
    jobs: set[int] = field(default_factory=set)

    def stop(self, timeout: float | None) -> Abandoned:
        """Stop the planes (at most `timeout` s), then unmap the region unless a copy still runs."""
        abandoned = Abandoned()
        for plane in self.planes:
            left = plane.shutdown(timeout)
            abandoned.jobs += left.jobs
            abandoned.tiers |= left.tiers
        if not abandoned.jobs:
            self.backend.close()  # (the owner's region stays; only this mapping goes)
        return abandoned


class HostRegionPlanes:
    """The host owner's regions as one worker maps them, and its jobs over them (module docstring).

    `build_planes(backend)` builds the (regular, expedited lane) planes over a mapped region;
    `block_bytes` / `block_tokens`: the region's geometry (this engine's identity); `pin`: the
    region's pinning mode in this process; `blocks_per_chunk`: engine blocks per offloaded block."""

    def __init__(self, build_planes: Callable[[Any], tuple[WorkerPlane, WorkerPlane]], block_bytes: int,
                 block_tokens: int, blocks_per_chunk: int, pin: str | bool = "auto"):
        self._build_planes = build_planes
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.blocks_per_chunk = blocks_per_chunk
        self.pin = pin
        self._current: _Region | None = None
        self._retired: list[_Region] = []
        self._by_job: dict[int, _Region] = {}
        self._short: dict[int, tuple[int, int]] = {}  # load job -> (positions pinned, positions loaded)
        self._failed: list[TransferResult] = []  # jobs failed without a copy, reported at the next poll
        self.attached = 0  # regions mapped so far (a new one per owner restart)

    @property
    def token(self) -> str | None:
        """The token of the region mapped now (None: none yet)."""
        return None if self._current is None else self._current.backend.token

    # ------------------------------------------------------------------ jobs
    def submit_store(self, job_id: int, gpu: kspecs.GPULoadStoreSpec, spec: KVTierHostLoadStoreSpec) -> None:
        """Copy the engine blocks `gpu` into the owner's slots `spec` (job `job_id`)."""
        region = self._region(spec, job_id)
        if region is not None:
            self._submit(region, region.planes[0], gpu, self._cpu(spec), job_id)

    def submit_load(self, job_id: int, spec: KVTierHostLoadStoreSpec, gpu: kspecs.GPULoadStoreSpec,
                    expedited: bool = False) -> None:
        """Load `spec`'s pinned keys into `gpu` and fail the others (module docstring)."""
        n, pinned = len(spec.keys) or len(spec.block_ids), spec.pinned
        if pinned < n:
            log.info("kvtier worker: load job %d: the host owner pinned %d of %d blocks; the other %d fail and "
                     "are recomputed", job_id, pinned, n, n - pinned)
            prefix = self._prefix(gpu, pinned)
            if prefix is None:
                self._fail(job_id, f"{n - pinned} of {n} blocks not pinned by the host owner", range(pinned, n))
                return
            gpu = prefix
            self._short[job_id] = (pinned, n)
        region = self._region(spec, job_id)
        if region is not None:
            self._submit(region, region.planes[1 if expedited else 0], self._cpu(spec), gpu, job_id)

    def _prefix(self, gpu: kspecs.GPULoadStoreSpec, pinned: int) -> kspecs.GPULoadStoreSpec | None:
        """The engine blocks of a one-group load's first `pinned` keys (its first key may cover
        only the last sub-blocks of its chunk); None when there is nothing to copy or several groups."""
        if pinned <= 0 or len(gpu.group_sizes) != 1:
            return None
        skip = gpu.block_indices[0] % self.blocks_per_chunk if gpu.block_indices else 0
        end = pinned * self.blocks_per_chunk - skip
        return kspecs.GPULoadStoreSpec(gpu.block_ids[:end], [end], gpu.block_indices)

    @staticmethod
    def _cpu(spec: KVTierHostLoadStoreSpec) -> kspecs.CPULoadStoreSpec:
        return kspecs.CPULoadStoreSpec(spec.block_ids, spec.tier)

    def _submit(self, region: _Region, plane: WorkerPlane, src: Any, dst: Any, job_id: int) -> None:
        try:
            plane.submit(src, dst, job_id)
        except Exception as exc:  # noqa: BLE001 - the job fails, the worker serves on
            self._short.pop(job_id, None)
            self._fail(job_id, f"{type(exc).__name__}: {exc}", ())
            return
        region.jobs.add(job_id)
        self._by_job[job_id] = region

    def _fail(self, job_id: int, why: str, positions: Iterable[int]) -> None:
        self._failed.append(TransferResult(job_id, False, 0, 0.0, error=why, failed_blocks=tuple(positions)))

    # ------------------------------------------------------------------ regions
    def _region(self, spec: KVTierHostLoadStoreSpec, job_id: int) -> _Region | None:
        """The mapped region `spec` names, mapped now if it is new (the current one is retired);
        None, with job `job_id` failed, when it cannot be mapped (gone, or another token)."""
        current = self._current
        if current is not None and spec.region == current.backend.token:
            return current
        for region in self._retired:  # (a job prepared before the owner restarted)
            if spec.region == region.backend.token:
                return region
        try:
            region = self._attach(spec)
        except Exception as exc:  # noqa: BLE001 - the job fails, never copies over another region
            self._short.pop(job_id, None)
            self._fail(job_id, f"cannot map the host owner's region {spec.shm_name}: {type(exc).__name__}: {exc}", ())
            log.warning("kvtier worker: job %d fails: cannot map the host owner's region %s (%s: %s)", job_id,
                        spec.shm_name, type(exc).__name__, exc)
            return None
        if current is not None:
            self._retire(current)
        self._current = region
        return region

    def _attach(self, spec: KVTierHostLoadStoreSpec) -> _Region:
        from kvtier.host.region import map_region
        from kvtier.tiers.cpu import RegionError

        if not spec.shm_name or spec.region is None:
            raise RegionError("the spec names no region (the host owner did not answer)")
        region = {"shm_name": spec.shm_name, "num_blocks": spec.num_blocks, "block_bytes": self.block_bytes,
                  "token": spec.region}
        backend, planes = map_region(region, spec.tier or "cpu", self.pin, self._build_planes, self.block_tokens)
        self.attached += 1
        log.info("kvtier worker: mapped the host owner's region %s (%d slots)", spec.shm_name, spec.num_blocks)
        return _Region(backend, planes)

    def _retire(self, region: _Region) -> None:
        """The owner names a new region: stop `region` once its jobs in flight are reported."""
        if region.jobs:
            self._retired.append(region)
        else:
            self._stop(region)

    @staticmethod
    def _stop(region: _Region) -> None:
        from kvtier.control.manager import SHUTDOWN_TIMEOUT_S

        abandoned = region.stop(SHUTDOWN_TIMEOUT_S)
        if abandoned.jobs:
            log.error("kvtier worker: copies still running on a retired host region after %g s, left mapped: %s",
                      SHUTDOWN_TIMEOUT_S, "; ".join(abandoned.jobs))

    # ------------------------------------------------------------------ results
    def poll(self) -> list[TransferResult]:
        """The jobs finished since the last call: a load that pinned fewer keys than it loads is
        reported failed at those positions (and at any of its copy's); a retired region whose
        jobs are all reported is stopped and unmapped."""
        results, self._failed = self._failed, []
        for region in self._regions():
            for plane in region.planes:
                results += [self._finished(r) for r in plane.poll()]
        for region in [r for r in self._retired if not r.jobs]:
            self._retired.remove(region)
            self._stop(region)
        return results

    def _finished(self, result: TransferResult) -> TransferResult:
        region = self._by_job.pop(result.job_id, None)
        if region is not None:
            region.jobs.discard(result.job_id)
        short = self._short.pop(result.job_id, None)
        if short is None:
            return result
        pinned, n = short
        failed = sorted(set(result.failed_positions(pinned)) | set(range(pinned, n)))
        return TransferResult(result.job_id, False, result.transfer_size, result.transfer_time,
                              error=result.error or f"{n - pinned} of {n} blocks not pinned by the host owner",
                              failed_blocks=tuple(failed))

    def _regions(self) -> list[_Region]:
        return [*([self._current] if self._current is not None else []), *self._retired]

    def wait(self, job_ids: set[int]) -> None:
        for region in self._regions():
            for plane in region.planes:
                plane.wait(job_ids)

    def shutdown(self, timeout: float | None = None) -> Abandoned:
        """Stop every region's planes within `timeout` s in all and unmap the regions (one whose
        copies are abandoned stays mapped). Idempotent."""
        deadline = None if timeout is None else time.monotonic() + timeout
        abandoned = Abandoned()
        regions, self._current, self._retired = self._regions(), None, []
        for region in regions:
            left = region.stop(None if deadline is None else max(0.0, deadline - time.monotonic()))
            abandoned.jobs += left.jobs
            abandoned.tiers |= left.tiers
        return abandoned
