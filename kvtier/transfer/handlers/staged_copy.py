"""The staged path of the CUDA engine <-> CPU handlers (`gpu_cpu.CudaKVCopyHandler`): what a job
does when no fast path serves it (no pinned region, a fast path that failed its self-check or a
job, or `KVTIER_GPU_COPY=staged`). A job runs on one of the handler's job threads, on its stream
(`h.stream`, after the compute-stream event `h.ready_event()`), through a device staging buffer
laid out like the slots: one non-blocking DMA when the slots are consecutive, else a pinned bounce
buffer and one batched host row copy; a layout that owns only a byte range of each slot always
goes through the bounce buffer. The thread waits for the job's end event before it returns."""

from __future__ import annotations

from typing import Any

from kvtier.core.specs import GPULoadStoreSpec
from kvtier.transfer.handlers.rows import common_words, run_start, words


def copy_whole_slots(h: Any, backend: Any, gpu: GPULoadStoreSpec, slots) -> None:
    """The job through a device staging buffer (and a pinned bounce buffer when the slots are
    not consecutive), for a layout whose rows are whole slots."""
    import torch

    k = len(slots)
    stride = backend.slot_stride
    # Whole slots (row stride = slot_stride): every DMA below is between contiguous tensors.
    region_bytes = backend.tensor().as_strided((backend.num_blocks, stride), (stride, 1))
    region = words(region_bytes)
    run = run_start(slots)
    consecutive = run is not None
    first = run or 0  # the run's first slot when consecutive
    with torch.cuda.device(h.device), torch.cuda.stream(h.stream):
        ready = h.ready_event()
        if ready is not None:
            h.stream.wait_event(ready)
        index = h.layout.index(gpu, k)
        rows = torch.arange(k, dtype=torch.int64)
        staging = torch.empty((k, stride), dtype=torch.uint8, device=h.device)
        done = torch.cuda.Event()
        if h.to_cpu:
            h.layout.gather(staging, rows, index)
            if consecutive:
                region_bytes[first:first + k].copy_(staging, non_blocking=True)
            else:
                bounce = torch.empty((k, stride), dtype=torch.uint8, pin_memory=True)
                bounce.copy_(staging, non_blocking=True)
            done.record(h.stream)
            done.synchronize()
            if not consecutive:
                dst, src_rows = common_words(region, words(bounce))
                h.layout.copier.index_copy(dst, slots, src_rows)
        else:
            if consecutive:
                staging.copy_(region_bytes[first:first + k], non_blocking=True)
            else:
                bounce = torch.empty((k, stride), dtype=torch.uint8, pin_memory=True)
                src_rows, out = common_words(region, words(bounce))
                h.layout.copier.index_select(src_rows, slots, out)
                staging.copy_(bounce, non_blocking=True)
            h.layout.scatter(staging, rows, index)
            done.record(h.stream)
            done.synchronize()


def copy_part_of_slots(h: Any, backend: Any, gpu: GPULoadStoreSpec, slots) -> None:
    """A job over the layout's byte range of each slot only (the slot is shared with other
    ranks): device staging of the part's width, a pinned bounce buffer, and one batched host
    row copy between it and the part's columns of the region."""
    import torch

    k, layout = len(slots), h.layout
    width = layout.slot_end - layout.slot_offset
    stride = backend.slot_stride
    whole = backend.tensor().as_strided((backend.num_blocks, stride), (stride, 1))
    part = words(whole[:, layout.slot_offset:layout.slot_offset + width])
    with torch.cuda.device(h.device), torch.cuda.stream(h.stream):
        ready = h.ready_event()
        if ready is not None:
            h.stream.wait_event(ready)
        index = layout.index(gpu, k)
        rows = torch.arange(k, dtype=torch.int64)
        staging = torch.empty((k, width), dtype=torch.uint8, device=h.device)
        bounce = torch.empty((k, width), dtype=torch.uint8, pin_memory=True)
        done = torch.cuda.Event()
        if h.to_cpu:
            layout.gather(staging, rows, index, base=0)
            bounce.copy_(staging, non_blocking=True)
            done.record(h.stream)
            done.synchronize()
            dst, src_rows = common_words(part, words(bounce))
            layout.copier.index_copy(dst, slots, src_rows)
        else:
            src_rows, out = common_words(part, words(bounce))
            layout.copier.index_select(src_rows, slots, out)
            staging.copy_(bounce, non_blocking=True)
            layout.scatter(staging, rows, index, base=0)
            done.record(h.stream)
            done.synchronize()
