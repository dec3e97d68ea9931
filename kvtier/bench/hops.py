"""Bandwidth of the engine <-> CPU-tier hop through kvtier's handlers, next to same-run baselines.

For each block size: the engine's KV cache is one tensor of `total_bytes / block_bytes` blocks (at
most `MAX_ENGINE_HOP_BLOCKS`, `MAX_HOP_BLOCKS` for blocks under a page) on `device` ("cuda", or
"cpu" for vLLM's CPU platform), the CPU tier a `CPUBackend` of as many slots (pinned when CUDA is
there). One job moves every block, engine blocks in shuffled order, once into
consecutive slots (what a fresh tier hands out) and once into scattered slots (a random permutation:
the steady state of a cache after churn). Measured in the same run, kvtier and its baseline
alternating in each of `repeats` rounds after one warm-up:
  - kvtier: the GPU->CPU / CPU->GPU handler (`kvtier.transfer.handlers.gpu_cpu`), submit to completion;
  - baseline: one contiguous copy of the same bytes (the ceiling);
  - naive (consecutive rows): one `copy_` per block in a Python loop (what the batched path replaces).
After measuring, each direction is run once more into cleared memory and every block compared with
its source: a transfer that corrupts bytes raises `TransferCorrupted`, it is never a figure.
Rows are plain dicts (`kvtier.bench.spread.annotate` adds samples, medians, spread and flags).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.bench.spread import annotate

_REPEATS = 3
SLOT_ORDERS = ("consecutive", "scattered")
# Blocks one measurement moves at most, whatever the block size: memory, file slots and the loops
# over blocks stay bounded (1-byte blocks would otherwise be hundreds of millions of them). The
# engine<->CPU hop moves up to MAX_ENGINE_HOP_BLOCKS blocks of a page or more, so that its bytes
# outgrow the CPU cache (1 GiB of 4 KiB blocks); smaller blocks cannot within any bounded count.
MAX_HOP_BLOCKS = 1 << 15
MAX_ENGINE_HOP_BLOCKS = 1 << 18
PAGE_BYTES = 4096


def hop_blocks(block_bytes: int, total_bytes: int, least: int = 1, most: int | None = None) -> int:
    """Blocks of `block_bytes` one measurement moves: `total_bytes` worth, at least `least`, at most
    `most` (default `MAX_HOP_BLOCKS`; so fewer bytes than `total_bytes` for blocks under total / most)."""
    return min(MAX_HOP_BLOCKS if most is None else most, max(least, total_bytes // block_bytes))


class TransferCorrupted(RuntimeError):
    """A measured transfer moved wrong bytes: the bench reports it instead of a figure."""


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _timed(fn: Callable[[], None], device: str) -> float:
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def interleaved(fns: Sequence[Callable[[], None]], device: str, repeats: int) -> list[list[float]]:
    """Seconds of each of `fns` in each of `repeats` rounds (one warm-up call each first); the
    functions alternate within a round, so a slow patch of the machine hits them alike."""
    for fn in fns:
        fn()
        _sync(device)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            out.append(_timed(fn, device))
    return samples


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
                    progress: Callable[[int, int], None] | None = None, repeats: int = _REPEATS,
                    slot_orders: Sequence[str] = SLOT_ORDERS) -> list[dict[str, Any]]:
    """GPU->CPU and CPU->GPU rows per block size and slot order: `hop`, `slots`, `device`,
    `block_bytes`, `blocks`, `bytes`, `baseline`, `naive_gbps` (consecutive rows), `pinned`,
    `torch_threads`, `verified`, and `annotate`'s samples, medians, spread and flags
    (GB/s = 1e9 bytes per second). Raises TransferCorrupted if a block arrives wrong."""
    rows: list[dict[str, Any]] = []
    for step, block_bytes in enumerate(block_bytes_list):
        for order in slot_orders:
            rows.extend(_gpu_cpu_rows(device, step, block_bytes, total_bytes, order, repeats))
        if progress:
            progress(step + 1, len(block_bytes_list))
    return rows


def _slots(n: int, order: str, seed: int) -> list[int]:
    import torch

    if order == "consecutive":
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(1000 + seed)).tolist()


def _verify(hop: str, block_bytes: int, moved: Callable[[], None], clear, check) -> None:
    """Clear the destination, run the transfer once, and compare every block with its source."""
    clear()
    moved()
    if not check():
        raise TransferCorrupted(f"{hop} with {block_bytes}-byte blocks moved wrong bytes: a defect of the "
                                f"handler, not a figure (please report it)")


def _copy_cases(device: str, engine, reference, region, engine_ids: list[int], slots: list[int],
                run_store: Callable[[], None], run_load: Callable[[], None]) -> tuple:
    """(hop, kvtier's transfer, the contiguous baseline, the naive loop, clear the destination,
    check every block) for GPU->CPU and then CPU->GPU, over `engine` and the CPU tier's `region`."""
    import torch

    engine_bytes = engine.view(torch.uint8)
    nb = device == "cuda"
    src_idx = torch.tensor(engine_ids, device=device)
    slot_idx = torch.tensor(slots)

    def contiguous_out() -> None:
        region.copy_(engine_bytes, non_blocking=nb)

    def contiguous_in() -> None:
        engine_bytes.copy_(region, non_blocking=nb)

    def naive_out() -> None:
        for slot, b in zip(slots, engine_ids):
            region[slot].copy_(engine_bytes[b], non_blocking=nb)

    def naive_in() -> None:
        for slot, b in zip(slots, engine_ids):
            engine_bytes[b].copy_(region[slot], non_blocking=nb)

    def stored_right() -> bool:
        expected = torch.empty_like(engine_bytes)
        expected[slot_idx.to(device)] = reference.view(torch.uint8)[src_idx]
        return bool(torch.equal(region.to(device), expected))

    def loaded_right() -> bool:
        return bool(torch.equal(engine, reference))

    return (("GPU->CPU", run_store, contiguous_out, naive_out, lambda: region.zero_(), stored_right),
            ("CPU->GPU", run_load, contiguous_in, naive_in, lambda: engine.zero_(), loaded_right))


def _timed_row(hop: str, order: str, device: str, block_bytes: int, n: int, pinned: bool, repeats: int,
               ours: Callable[[], None], base: Callable[[], None], naive: Callable[[], None]) -> dict[str, Any]:
    """One hop's row: kvtier and the baseline interleaved (`annotate`), the naive loop once."""
    import torch

    ours_s, base_s = interleaved((ours, base), device, repeats)
    nbytes = n * block_bytes
    row: dict[str, Any] = {
        "hop": hop, "slots": order, "device": device, "block_bytes": block_bytes, "blocks": n,
        "bytes": nbytes, "baseline": "one contiguous copy", "pinned": pinned,
        "torch_threads": torch.get_num_threads(),
        # the same copy whatever the block size and slot order: its rows of one run should agree
        "baseline_key": f"{hop} one contiguous copy of {nbytes} bytes on {device}"}
    annotate(row, ours_s, base_s, nbytes, host_copy=device == "cpu")
    if order == "consecutive":  # once, cold: a loop of small copies needs no warm-up to show its cost
        row["naive_gbps"] = nbytes / _timed(naive, device) / 1e9
    return row


def _gpu_cpu_rows(device: str, step: int, block_bytes: int, total_bytes: int, order: str,
                  repeats: int) -> list[dict[str, Any]]:
    """Both GPU<->CPU rows for one block size and slot order (a function of its own so that the
    timed closures bind this call's tensors, which are released when it returns)."""
    import torch

    from kvtier.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
    from kvtier.core.types import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    from kvtier.tiers.cpu import CPUBackend
    from kvtier.transfer.handlers.gpu_cpu import make_handler

    rows: list[dict[str, Any]] = []
    n = hop_blocks(block_bytes, total_bytes, least=2,
                   most=MAX_ENGINE_HOP_BLOCKS if block_bytes >= PAGE_BYTES else MAX_HOP_BLOCKS)
    engine = torch.randint(-128, 128, (n, block_bytes), dtype=torch.int8, device=device)
    reference = engine.clone()
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(engine, block_bytes)], [[CanonicalKVCacheRef(0, block_bytes)]])
    tier = CPUBackend("bench", n, block_bytes)
    store = load = None
    try:
        region = tier.tensor()
        engine_ids = torch.randperm(n, generator=torch.Generator().manual_seed(step)).tolist()
        slots = _slots(n, order, step)
        gpu_spec = GPULoadStoreSpec(engine_ids)
        cpu_spec = CPULoadStoreSpec(slots, tier="bench")
        store = make_handler({"bench": tier}, kv, to_cpu=True)
        load = make_handler({"bench": tier}, kv, to_cpu=False)
        assert store is not None and load is not None, "a CPU tier always has GPU<->CPU handlers"
        run_store, run_load = _job_runner(store), _job_runner(load)
        cases = _copy_cases(device, engine, reference, region, engine_ids, slots,
                            lambda: run_store(gpu_spec, cpu_spec), lambda: run_load(cpu_spec, gpu_spec))
        for hop, ours, base, naive, clear, check in cases:
            row = _timed_row(hop, order, device, block_bytes, n, tier.pinned, repeats, ours, base, naive)
            if hop == "CPU->GPU":  # the timed copies scrambled both sides: put the reference in its slots
                engine.copy_(reference)
                run_store(gpu_spec, cpu_spec)
            _verify(f"{hop} ({order} slots)", block_bytes, ours, clear, check)
            row["verified"] = True
            rows.append(row)
    finally:  # a failed check too: the handlers' threads and streams end before the region goes
        for handler in (store, load):
            if handler is not None:
                handler.shutdown()
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
