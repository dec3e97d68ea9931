"""The host work of one engine <-> CPU job on the CUDA fast path, on any machine (no GPU needed):
planning with the reference planner (`copy_plan.plan_copies`, what the handlers ran before
issue 37), the compiled planner (`job_plan.plan_job`) and its pure-Python twin, side by side
in one run, and the whole `CudaKVCopyHandler.submit` of a job (validation, planning, stream and
event calls, hand-off to the completion thread) with CUDA's streams and events as no-ops
(`tests.support.fake_cuda`) and a submitter that does nothing.

    python scripts/bench_gpu_copy.py --plan-only --json OUT.json [--pages 64KiB,256KiB,2MiB]
                                     [--layers 1,32] [--blocks 256] [--slots scattered,consecutive]

A job is `--blocks` engine blocks of one KV group whose block is `page` bytes split over
`--layers` tensors (one reference each, `page / layers` bytes per tensor); slots a random
permutation (scattered: one descriptor per block and layer) or consecutive (one tensor: the job
merges into one descriptor; several: one per layer and block, engine rows of different tensors
never continue one another). Memory is
reserved, never touched: the planners only compute addresses. Figures are microseconds per
job: the median over `--rounds` rounds of the mean of `--jobs` jobs, the planners interleaved
round by round so that they share the machine's state.
"""

from __future__ import annotations

import random
import statistics
import time


def layout_and_region(torch, page: int, layers: int, blocks: int):
    """A layout of `layers` tensors of `page // layers` bytes per block, and a CPU region of
    `2 * blocks` slots of `page` bytes, back to back (as the CPU tier lays out page-sized blocks)."""
    from kvtier import CanonicalKVCaches, CanonicalKVCacheTensor
    from kvtier.transfer.handlers.kv_layout import KVLayout

    part = page // layers
    tensors = [CanonicalKVCacheTensor(torch.empty((blocks, part), dtype=torch.uint8), part) for _ in range(layers)]
    layout = KVLayout(CanonicalKVCaches(tensors, None), 1)
    region = torch.empty((2 * blocks, layout.block_bytes), dtype=torch.uint8)
    return layout, region


def per_job_us(runs: dict, rounds: int, jobs: int) -> dict:
    """{name: median us per call} of each `runs[name]()`, interleaved round by round."""
    samples: dict = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm up (geometry made, code paths loaded)
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(jobs):
                run()
            samples[name].append((time.perf_counter() - start) / jobs * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


class NoSubmit:
    """A fast path that submits nothing (the planning and bookkeeping around it are measured)."""

    name = "no-op"

    def submit(self, plan, stream: int) -> None:
        pass


def handler_submit_us(torch, layout, page: int, spec, slots, rounds: int, jobs: int) -> float:
    """Median us per `CudaKVCopyHandler.submit` of the job on host tensors (stand-in CUDA)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support
    from kvtier import CPULoadStoreSpec
    from kvtier.tiers.memory import MemoryBackend
    from kvtier.transfer.handlers.gpu_cpu import CudaKVCopyHandler
    from tests.support.fake_cuda import patched

    backend = MemoryBackend("bench", 2 * len(slots), layout.block_bytes)
    backend.pinned = True
    with patched(torch):
        handler = CudaKVCopyHandler({"bench": backend}, layout, True)
        handler._fast, handler._fast_known = NoSubmit(), True
        failed: list = []
        handler.bind(lambda result: None if result.success else failed.append(result))
        counter = iter(range(1 << 40))
        cpu = CPULoadStoreSpec(slots, tier="bench")
        try:
            figure = per_job_us({"submit": lambda: handler.submit(next(counter), spec, cpu)}, rounds, jobs)["submit"]
            handler.wait(range(next(counter)))
        finally:
            handler.shutdown()
            backend.close()
    if failed:
        raise RuntimeError(f"a job failed: {failed[0].error}")
    return figure


def plan_row(torch, layout, region, page: int, layers: int, blocks: int, order: str, rounds: int,
             jobs: int) -> dict:
    """us per job of each planner and of the handler's submit, for one layout and slot order."""
    from kvtier import GPULoadStoreSpec
    from kvtier.transfer.handlers import job_plan
    from kvtier.transfer.handlers.copy_plan import plan_copies
    from kvtier.transfer.handlers.job_plan import RegionRef, plan_job, plan_job_py

    ref = RegionRef.of(region)
    spec = GPULoadStoreSpec(list(range(blocks)))
    slots = (random.Random(page + layers).sample(range(2 * blocks), blocks) if order == "scattered"
             else list(range(blocks)))
    g = job_plan.PlanGeometry.of(layout)

    def twin():
        return plan_job_py(spec.block_ids, spec.group_sizes, spec.block_indices, slots, g.seg_first, g.engine_base,
                           g.engine_stride, g.page, g.place, g.bpc, g.engine_blocks, ref.base, ref.stride, ref.rows,
                           True)

    figures = per_job_us({"reference_us": lambda: plan_copies(layout, spec, slots, region, True),
                          "compiled_us": lambda: plan_job(layout, spec, slots, ref, True),
                          "twin_us": twin}, rounds, jobs)
    return {"page": page, "layers": layers, "blocks": blocks, "slots": order,
            "descriptors": len(plan_job(layout, spec, slots, ref, True)),
            "compiled": job_plan.compiled_planner() is not None, **figures,
            "handler_submit_us": handler_submit_us(torch, layout, page, spec, slots, rounds, jobs)}


def plan_rows(pages: list[int], layers: list[int], blocks: int, orders: list[str], rounds: int = 15,
              jobs: int = 40) -> list[dict]:
    """One row per (page, layers, slot order): us per job of each planner and of the handler's submit."""
    import torch

    rows = []
    for page in pages:
        for count in layers:
            layout, region = layout_and_region(torch, page, count, blocks)
            for order in orders:
                row = plan_row(torch, layout, region, page, count, blocks, order, rounds, jobs)
                rows.append(row)
                print(f"{page >> 10:>5} KiB x {count:>2} layers, {blocks} blocks {order:<11} "
                      f"{row['descriptors']:>5} descriptors: reference {row['reference_us']:7.1f} us, "
                      f"compiled {row['compiled_us']:6.1f} us, twin {row['twin_us']:7.1f} us; "
                      f"handler submit {row['handler_submit_us']:6.1f} us", flush=True)
            layout.close()
    return rows
