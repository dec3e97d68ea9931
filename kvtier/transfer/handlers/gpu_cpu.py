"""Copies between the engine's KV cache (`CanonicalKVCaches`) and the CPU tier, in batches.

Where each engine page goes in a slot is `KVLayout`'s (`kvtier.transfer.handlers.kv_layout`, with the
layout described there); the host row copies are `kvtier.transfer.handlers.rows`'. The CPU side is any
`HostRegion` backend (`kvtier.tiers.base`: the shared-memory CPUBackend, MemoryBackend).

On CUDA the copies run on a dedicated stream that first waits for the compute stream; a
completion thread waits for the job's event. Each page moves by DMA straight between the engine and
its place in the pinned slot: the job's descriptors (`kvtier.transfer.handlers.copy_plan`, adjacent runs
merged) go to the device in one call (`kvtier.transfer.handlers.cuda_copy`), once that fast path passed its
self-check on the device (`kvtier.transfer.handlers.fast_path`). Otherwise (or with `KVTIER_GPU_COPY=staged`)
a job goes through a device staging buffer laid out like the slots and one DMA per job, with a
pinned bounce buffer and host row copies when the slots are not consecutive. Each handler owns its
layout and closes it (and the layout's copy threads) in `shutdown`.

A handler copies only its layout's byte range of each slot (`KVLayout.slot_offset` /
`slot_length`): several worker ranks, each with its own handler, share one slot without touching
each other's bytes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.core.specs import BlockIDsLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvtier.core.types import CanonicalKVCaches, TransferResult
from kvtier.tiers.base import HostRegion
from kvtier.transfer.handlers.base import (
    SyncHandler,
    ThreadedHandler,
    TransferHandler,
    failed_result,
    pick_backend,
    serving,
)
from kvtier.transfer.handlers.completions import Completions
from kvtier.transfer.handlers.cuda_copy import CopyError
from kvtier.transfer.handlers.job_plan import RegionRef, plan_job
from kvtier.transfer.handlers.kv_layout import (
    ChunkedKVCaches,
    KVLayout,
    Segment,
    blocks_per_chunk_of,
    byte_rows,
    slot_range_of,
)
from kvtier.transfer.handlers.staged_copy import copy_part_of_slots, copy_whole_slots


def _split(to_cpu: bool, src: LoadStoreSpec, dst: LoadStoreSpec) -> tuple[GPULoadStoreSpec, BlockIDsLoadStoreSpec]:
    gpu, cpu = (src, dst) if to_cpu else (dst, src)
    if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(cpu, BlockIDsLoadStoreSpec):
        raise TypeError(f"expected a GPU spec and a slot spec, got {type(src).__name__} -> {type(dst).__name__}")
    return gpu, cpu


def _check_fits(backend: Any, layout: KVLayout) -> None:
    """ValueError unless the tier's blocks hold the layout's byte range."""
    if backend.block_bytes < layout.slot_end:
        raise ValueError(f"tier {backend.name!r} has {backend.block_bytes} B blocks, the KV layout needs "
                         f"{layout.slot_end} B (bytes {layout.slot_offset}..{layout.slot_end} of each slot)")


class HostKVCopyHandler(SyncHandler):
    """Engine KV cache in CPU tensors <-> CPU tier: batched index copies, synchronous in `submit`.
    A failing job reports `success=False`; other jobs are unaffected."""

    def __init__(self, backends: Mapping[str, Any], layout: KVLayout, to_cpu: bool):
        super().__init__()
        self.backends, self.layout, self.to_cpu = dict(backends), layout, to_cpu

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        import torch

        gpu, cpu = _split(self.to_cpu, src, dst)
        backend = pick_backend(self.backends, cpu, "CPU")
        _check_fits(backend, self.layout)
        index = self.layout.index(gpu, len(cpu.block_ids))
        rows = torch.tensor(cpu.block_ids, dtype=torch.int64)
        if len(rows) and int(rows.max()) >= backend.num_blocks:
            raise IndexError(f"slot {int(rows.max())} >= {backend.num_blocks} slots of tier {backend.name!r}")
        region = backend.tensor()
        if self.to_cpu:
            self.layout.gather(region, rows, index)
        else:
            self.layout.scatter(region, rows, index)
        return self.layout.bytes_of(gpu)

    def shutdown(self) -> None:
        self.layout.close()


class EngineJobHandler(ThreadedHandler):
    """A `ThreadedHandler` for jobs that touch the engine's KV cache.

    - On CUDA, `submit` records an event on the caller's current (compute) stream
      (`record_ready`); the job's thread makes its own stream wait for it (`ready_event()`), so a
      store reads the KV only after the model wrote it and a load writes only after earlier work
      on those blocks.
    - `wait(job_ids)` returns only after each job's result was reported (`on_done` called).
    - It owns `layout`: `shutdown` waits for the running jobs, then closes the layout.
    """

    def __init__(self, layout: KVLayout, num_threads: int, thread_name: str):
        super().__init__(num_threads=num_threads, thread_name=thread_name)
        self.layout = layout
        self.device = layout.device
        self.cuda = self.device.type == "cuda"
        self._ready: dict[int, Any] = {}
        self._reported: dict[int, threading.Event] = {}
        self._job_lock = threading.Lock()
        self._job_local = threading.local()

    def record_ready(self) -> Any:
        """The event a job submitted now must wait for, recorded on the caller's current (compute)
        stream; None off CUDA (nothing to wait for). `submit` calls it on the submitting thread; the
        job's thread sees the event as `ready_event()`, and the handler drops it when the job ends."""
        if not self.cuda:
            return None
        import torch

        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return ready

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        ready = self.record_ready()
        with self._job_lock:
            if ready is not None:
                self._ready[job_id] = ready
            self._reported[job_id] = threading.Event()
        super().submit(job_id, src, dst)

    def _run(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        with self._job_lock:
            self._job_local.ready = self._ready.pop(job_id, None)
        try:
            super()._run(job_id, src, dst)  # reports through on_done
        finally:
            # No CUDA object may outlive its job in thread-local state: a fork tears other
            # threads' states down in the child, and destroying a CUDA event there aborts it.
            self._job_local.ready = None
            with self._job_lock:
                reported = self._reported.pop(job_id, None)
            if reported is not None:
                reported.set()

    def ready_event(self):
        """The compute-stream event of the job running on this thread (None off CUDA)."""
        return getattr(self._job_local, "ready", None)

    def wait(self, job_ids) -> None:
        with self._job_lock:
            pending = [self._reported[j] for j in job_ids if j in self._reported]
        for event in pending:
            event.wait()

    def shutdown(self) -> None:
        super().shutdown()
        self.layout.close()


class CudaKVCopyHandler(EngineJobHandler):
    """Engine KV cache on CUDA <-> pinned CPU tier, on one dedicated stream; each job's stream
    work first waits for the compute stream's event recorded at `submit` (`record_ready`).

    With a pinned region and a fast path that passed its self-check on the device
    (`fast_path.cuda_fast_path`), every page moves straight between the engine and its slot: one
    plan of descriptors per job (`job_plan.plan_job`), whatever the slot order and for a byte range of
    each slot too, planned and submitted in one call in `submit`, on the caller's thread; the
    job's end event goes to `Completions`, whose thread reports the job once it fired (jobs end
    in submission order). Host work on one thread keeps the stream fed (job threads convoyed on
    the GIL; measured figures: docs/benchmarks.md). A submission the fast path refuses
    (`CopyError`) demotes it, and the job is redone on the staged path.

    Otherwise (the staged path) job threads (`threads`, default two) run the jobs and may complete
    them out of order: a job gathers/scatters on the device through a staging buffer laid out like
    the slots and moves it with one non-blocking DMA when the slots are consecutive, else through
    a pinned bounce buffer and one batched host-side row copy; a layout that owns only a byte
    range of each slot always goes through the bounce buffer there. The thread waits for the
    job's end event, then reports.
    """

    def __init__(self, backends: Mapping[str, Any], layout: KVLayout, to_cpu: bool, threads: int = 2):
        # The staged path's job threads, on one stream: a job's host work overlaps the previous
        # job's copies. Each job's stream work is in order: wait for its event, copy, record its end.
        name = "kvtier-gpu-cpu" if to_cpu else "kvtier-cpu-gpu"
        super().__init__(layout, threads, name)
        import torch

        self.backends, self.to_cpu = dict(backends), to_cpu
        self.stream = torch.cuda.Stream(device=self.device)
        self._fast: Any = None
        self._fast_known = False  # the fast path is decided (self-checked) on the first job
        self._regions: dict[str, tuple[Any, RegionRef]] = {}  # tier name -> (backend, its slots for the planner)
        self._completions = Completions(f"{name}-done", self._complete)

    def fast_path(self) -> Any:
        """The device's self-checked fast path (a `cuda_copy.Submitter`), or None: the staged path
        (for good once a job failed in the fast path: that job is redone on the staged path)."""
        if not self._fast_known:
            from kvtier.transfer.handlers.fast_path import cuda_fast_path

            largest = max(self.layout.groups, key=lambda segments: sum(seg.page for seg in segments))
            self._fast, self._fast_known = cuda_fast_path(self.device, tuple(seg.page for seg in largest)), True
        return self._fast

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        """The fast path's job planned and submitted here, reported by `Completions`; any other
        on a job thread (class docstring). A job that cannot start is reported failed at once."""
        start = time.perf_counter()
        try:
            gpu, cpu = _split(self.to_cpu, src, dst)
            backend = pick_backend(self.backends, cpu, "CPU")
            fast = self.fast_path() if getattr(backend, "pinned", False) else None
            region = self._region(backend) if fast is not None else None
        except Exception as exc:  # noqa: BLE001 - a bad job fails this job only
            return self.report(failed_result(job_id, start, exc))
        if fast is None or region is None:
            return super().submit(job_id, src, dst)
        with self._job_lock:
            self._reported[job_id] = threading.Event()
        try:
            done = self._submit_direct(fast, region, gpu, cpu.block_ids)
        except CopyError as exc:  # the staged path redoes the whole job, on the same stream
            from kvtier.transfer.handlers.fast_path import demote_cuda

            self._fast = None
            demote_cuda(self.device, fast, str(exc))
            with self._job_lock:
                self._reported.pop(job_id, None)
            return super().submit(job_id, src, dst)
        except Exception as exc:  # noqa: BLE001 - fails this job only
            return self._complete(failed_result(job_id, start, exc))
        self._completions.add(job_id, done, self.layout.bytes_of(gpu), start)

    def _region(self, backend: Any) -> RegionRef:
        """The slots of `backend` as numbers for the planner (checked to fit the layout once)."""
        cached = self._regions.get(backend.name)
        if cached is None or cached[0] is not backend:
            _check_fits(backend, self.layout)
            stride = backend.slot_stride
            region = backend.tensor().as_strided((backend.num_blocks, stride), (stride, 1))
            cached = self._regions[backend.name] = (backend, RegionRef.of(region))
        return cached[1]

    def _complete(self, result: TransferResult) -> None:
        self.report(result)
        with self._job_lock:
            reported = self._reported.pop(result.job_id, None)
        if reported is not None:
            reported.set()

    def _job(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> tuple[GPULoadStoreSpec, Any, Any]:
        """(engine spec, CPU backend, slot ids as an int64 tensor) of a job, checked."""
        import torch

        gpu, cpu = _split(self.to_cpu, src, dst)
        backend = pick_backend(self.backends, cpu, "CPU")
        _check_fits(backend, self.layout)
        slots = torch.as_tensor(cpu.block_ids, dtype=torch.int64)
        if len(slots) and int(slots.max()) >= backend.num_blocks:
            raise IndexError(f"slot {int(slots.max())} >= {backend.num_blocks} slots of tier {backend.name!r}")
        return gpu, backend, slots

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        """A staged-path job, on a job thread."""
        gpu, backend, slots = self._job(src, dst)
        if self.layout.owns_whole_slot:
            copy_whole_slots(self, backend, gpu, slots)
        else:
            copy_part_of_slots(self, backend, gpu, slots)
        return self.layout.bytes_of(gpu)

    def shutdown(self) -> None:
        self._completions.close()
        super().shutdown()

    def _submit_direct(self, fast: Any, region: RegionRef, gpu: GPULoadStoreSpec, slots: list[int]) -> Any:
        """The job as one plan of page <-> slot-place DMAs (`plan_job`), submitted on the handler's
        stream after the caller's current stream's work so far; returns the event recorded after them."""
        import torch

        plan = plan_job(self.layout, gpu, slots, region, self.to_cpu)
        ready = self.record_ready()  # (on the caller's current stream)
        with torch.cuda.device(self.device):
            self.stream.wait_event(ready)
            fast.submit(plan, self.stream.cuda_stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done


def make_handler(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None, to_cpu: bool,
                 blocks_per_chunk: int = 1, slot_offset: int = 0,
                 slot_length: int | None = None, cuda_threads: int = 2) -> TransferHandler | None:
    """A GPU->CPU (`to_cpu`) or CPU->GPU handler over the `HostRegion` backends, or None without
    KV caches or such backends. It copies bytes `[slot_offset, slot_offset + slot_length)` of each
    slot (default: the whole slot); on CUDA with `cuda_threads` job threads."""
    if kv_caches is None:
        return None
    usable = serving(backends, HostRegion)
    if not usable:
        return None
    layout = KVLayout(kv_caches, blocks_per_chunk, slot_offset, slot_length)
    if layout.device.type == "cuda":
        from kvtier.transfer.handlers.fast_path import candidates_for

        candidates_for(os.environ.get("KVTIER_GPU_COPY", "auto"))  # a bad value fails here, not each job
        handler = CudaKVCopyHandler(usable, layout, to_cpu, cuda_threads)
        if any(getattr(b, "pinned", False) for b in usable.values()):
            handler.fast_path()  # chosen (self-checked, timed, logged) now, at start-up, not at the first job
        return handler
    if layout.device.type != "cpu":
        raise ValueError(f"unsupported KV cache device {layout.device}")
    return HostKVCopyHandler(usable, layout, to_cpu)


def make_gpu_to_cpu(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None) -> TransferHandler | None:
    """Registry factory for GPULoadStoreSpec -> CPULoadStoreSpec."""
    return make_handler(backends, kv_caches, True, blocks_per_chunk_of(kv_caches), *slot_range_of(kv_caches))


def make_cpu_to_gpu(backends: Mapping[str, Any], kv_caches: CanonicalKVCaches | None) -> TransferHandler | None:
    """Registry factory for CPULoadStoreSpec -> GPULoadStoreSpec."""
    return make_handler(backends, kv_caches, False, blocks_per_chunk_of(kv_caches), *slot_range_of(kv_caches))


__all__: Sequence[str] = ["ChunkedKVCaches", "KVLayout", "Segment", "EngineJobHandler", "HostKVCopyHandler",
                          "CudaKVCopyHandler", "byte_rows",
                          "make_gpu_to_cpu", "make_cpu_to_gpu", "make_handler"]
