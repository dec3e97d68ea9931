"""Bandwidth of the engine <-> CPU-tier hop through kvtier's handlers, next to same-run baselines.

For each block size: the engine's KV cache is one tensor of `total_bytes / block_bytes` blocks on
`device` ("cuda", or "cpu" for vLLM's CPU platform), the CPU tier a `CPUBackend` of as many slots
(pinned when CUDA is there). One job moves every block, engine blocks in shuffled order into
consecutive slots (what a fresh tier hands out). Measured in the same run:
  - kvtier: the GPU->CPU / CPU->GPU handler (`kvtier.handlers.gpu_cpu`), submit to completion;
  - baseline: one contiguous copy of the same bytes (the ceiling);
  - naive: one `copy_` per block in a Python loop (what the batched path replaces).
Each figure is the best of a few repetitions after one warm-up. Rows are plain dicts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

_REPEATS = 3


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _best(fn: Callable[[], None], device: str, repeats: int = _REPEATS) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _job_runner(handler) -> Callable[[Any, Any], Any]:
    """Submit one job and wait for its completion callback; raises if the job failed."""
    done = threading.Event()
    box: list = []

    def on_done(result) -> None:
        box.append(result)
        done.set()

    handler.bind(on_done)

    def run(src, dst) -> None:
        done.clear()
        box.clear()
        handler.submit(1, src, dst)
        done.wait()
        if not box[0].success:
            raise RuntimeError(f"benchmark job failed: {box[0].error}")
    return run


def measure_gpu_cpu(device: str, block_bytes_list: Sequence[int], total_bytes: int,
                    progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """GPU->CPU and CPU->GPU rows per block size: `hop`, `device`, `block_bytes`, `blocks`,
    `bytes`, `seconds`, `gbps`, `baseline`, `baseline_seconds`, `baseline_gbps`, `naive_seconds`,
    `naive_gbps`, `pinned`, `torch_threads` (GB/s = 1e9 bytes per second)."""
    rows: list[dict[str, Any]] = []
    for step, block_bytes in enumerate(block_bytes_list):
        rows.extend(_gpu_cpu_rows(device, step, block_bytes, total_bytes))
        if progress:
            progress(step + 1, len(block_bytes_list))
    return rows


def _gpu_cpu_rows(device: str, step: int, block_bytes: int, total_bytes: int) -> list[dict[str, Any]]:
    """Both GPU<->CPU rows for one block size (a function of its own so that the timed closures
    bind this call's tensors, which are released when it returns)."""
    import torch

    from kvtier.handlers.gpu_cpu import make_handler
    from kvtier.specs import CPULoadStoreSpec, GPULoadStoreSpec
    from kvtier.tiers.cpu import CPUBackend
    from kvtier.types import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    rows: list[dict[str, Any]] = []
    n = max(2, total_bytes // block_bytes)
    engine = torch.randint(-128, 128, (n, block_bytes), dtype=torch.int8, device=device)
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(engine, block_bytes)], [[CanonicalKVCacheRef(0, block_bytes)]])
    tier = CPUBackend("bench", n, block_bytes)
    try:
        region = tier.tensor()
        engine_ids = torch.randperm(n, generator=torch.Generator().manual_seed(step)).tolist()
        gpu_spec = GPULoadStoreSpec(engine_ids)
        cpu_spec = CPULoadStoreSpec(list(range(n)), tier="bench")
        store = make_handler({"bench": tier}, kv, to_cpu=True)
        load = make_handler({"bench": tier}, kv, to_cpu=False)
        assert store is not None and load is not None, "a CPU tier always has GPU<->CPU handlers"
        run_store, run_load = _job_runner(store), _job_runner(load)
        engine_bytes = engine.view(torch.uint8)
        flat = region if tier.slot_stride == block_bytes else None
        nb = device == "cuda"

        def contiguous_out() -> None:
            (flat if flat is not None else region).copy_(engine_bytes, non_blocking=nb)

        def contiguous_in() -> None:
            engine_bytes.copy_(flat if flat is not None else region, non_blocking=nb)

        def naive_out() -> None:
            for slot, b in enumerate(engine_ids):
                region[slot].copy_(engine_bytes[b], non_blocking=nb)

        def naive_in() -> None:
            for slot, b in enumerate(engine_ids):
                engine_bytes[b].copy_(region[slot], non_blocking=nb)

        cases = (("GPU->CPU", lambda: run_store(gpu_spec, cpu_spec), contiguous_out, naive_out),
                 ("CPU->GPU", lambda: run_load(cpu_spec, gpu_spec), contiguous_in, naive_in))
        nbytes = n * block_bytes
        for hop, ours, base, naive in cases:
            seconds = _best(ours, device)
            base_s = _best(base, device)
            naive_s = _best(naive, device, repeats=1)
            rows.append({"hop": hop, "device": device, "block_bytes": block_bytes, "blocks": n, "bytes": nbytes,
                         "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                         "baseline": "one contiguous copy", "baseline_seconds": base_s,
                         "baseline_gbps": nbytes / base_s / 1e9,
                         "naive_seconds": naive_s, "naive_gbps": nbytes / naive_s / 1e9,
                         "pinned": tier.pinned, "torch_threads": torch.get_num_threads()})
        store.shutdown()
        load.shutdown()
    finally:
        tier.close()
    return rows


def measure_cpu_ready(nbytes: int, block_bytes: int = 2 << 20) -> float:
    """Seconds to make a CPU tier of `nbytes` ready (created, mapped, pinned when CUDA is there)."""
    from kvtier.tiers.cpu import CPUBackend

    start = time.perf_counter()
    tier = CPUBackend("ready-bench", max(1, nbytes // block_bytes), block_bytes)
    seconds = time.perf_counter() - start
    tier.close()
    return seconds
