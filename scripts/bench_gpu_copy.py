"""Engine <-> CPU tier on CUDA with scattered slots (a cache after churn), against one contiguous
pinned copy of the same bytes: GB/s and ratio per page size, direction and copy path.

    python scripts/bench_gpu_copy.py --json OUT.json [--total-mib 512] [--pages 64KiB,256KiB,2MiB]
                                     [--slots scattered,consecutive] [--job-mib 16] [--repeats 3]
                                     [--modes staged,auto,...] [--threads 2[,4,...]] [--no-both]
    python scripts/bench_gpu_copy.py --plan-only --json OUT.json [--layers 1,32] [--blocks 256] ...

Each measurement moves `--total-mib` through the real handlers (`make_handler` over a pinned
`CPUBackend`), in jobs of 16 MiB (256 blocks of 64 KiB, 16 of 2 MiB, as vLLM submits them),
slots a random permutation (and, for comparison, consecutive); best of `--repeats`. Paths:
`staged` (the bounce path), `auto` (the fast path the self-check chose, named in the JSON), and
`batch`, `bindings`, `loop` and `kernel` each alone (`KVTIER_GPU_COPY`; `--modes` picks some);
`--job-mib` sets the job size, `--threads` the handlers' job threads. Every load is checked byte
for byte against the engine's bytes before the store.

**Both directions at once** (unless `--no-both`): the engine's blocks in two halves, the first
half stored while the second is loaded, the two handlers' jobs submitted alternately from one
thread (as a serving engine stores and loads in one step); `both_gbps` is all bytes moved over
the wall time, `both_ratio` that over the faster one-direction contiguous copy (vLLM measured
83.4 GB/s, ~1.5x, on an H100). Its ceiling, a contiguous D2H and a contiguous H2D of half the
bytes each on two streams at once, is `contiguous_both_gbps`.

`--plan-only` runs anywhere (no GPU): the host work of one job, the reference planner against
the compiled one, side by side (`scripts/bench_gpu_copy_plan.py` says what is measured).
Otherwise exits 2 with "skipped: no CUDA" where torch sees no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

JOB_BYTES = 16 << 20
MODES = ("staged", "auto", "batch", "bindings", "loop", "kernel")


def contiguous_gbps(torch, nbytes: int, repeats: int) -> tuple[float, float, float]:
    """(device->host, host->device, both at once) GB/s of contiguous copies between a device buffer
    and pinned memory; both at once: half the bytes each way, on two streams."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    half = nbytes // 2
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def both():
        for stream, (dst, src) in zip(streams, ((host[:half], dev[:half]), (dev[half:], host[half:]))):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

    out = []
    for run in (lambda: host.copy_(dev, non_blocking=True), lambda: dev.copy_(host, non_blocking=True), both):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out.append(nbytes / best / 1e9)
    return out[0], out[1], out[2]


def run_jobs(handler, jobs, results, other=None, other_jobs=()) -> float:
    """Submit every job (alternating with `other_jobs` on the handler `other`, if given), wait for
    all; seconds taken. Raises if a job failed."""
    start = time.perf_counter()
    for job_id in range(max(len(jobs), len(other_jobs))):
        if job_id < len(jobs):
            handler.submit(job_id, *jobs[job_id])
        if job_id < len(other_jobs):
            other.submit(len(jobs) + job_id, *other_jobs[job_id])
    handler.wait(range(len(jobs)))
    if other is not None:
        other.wait(range(len(jobs), len(jobs) + len(other_jobs)))
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"job {failed[0].job_id} failed: {failed[0].error}")
    results.clear()
    return elapsed


def both_at_once(torch, store, load, stores, loads, results, engine, original, repeats: int) -> float:
    """Best seconds to store the first half of the jobs while loading the second half (whose slots
    hold their bytes from the one-direction runs); the loaded half is checked byte for byte."""
    half = len(stores) // 2
    blocks = [i for spec, _ in stores[half:] for i in spec.block_ids]
    best = float("inf")
    for _ in range(repeats):
        engine[blocks] = 0
        torch.cuda.synchronize()
        best = min(best, run_jobs(store, stores[:half], results, load, loads[half:]))
        if not torch.equal(engine[blocks], original[blocks]):
            raise RuntimeError("both directions at once: the loaded bytes differ from the stored ones")
    return best


def measure(torch, page: int, total: int, mode: str, repeats: int, order: str,
            job_bytes: int = JOB_BYTES, threads: int = 2, both: bool = True) -> dict:
    from kvtier import CanonicalKVCaches, CanonicalKVCacheTensor, CPULoadStoreSpec, GPULoadStoreSpec
    from kvtier.tiers.cpu import CPUBackend
    from kvtier.transfer.handlers import fast_path
    from kvtier.transfer.handlers.gpu_cpu import make_handler

    os.environ["KVTIER_GPU_COPY"] = mode
    fast_path.CHOICE.forget()
    n = total // page
    engine = torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda")
    original = engine.clone()
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(engine, page)], None)
    backend = CPUBackend("bench", n, page, pin="true")
    store = make_handler({"bench": backend}, kv, True, cuda_threads=threads)
    load = make_handler({"bench": backend}, kv, False, cuda_threads=threads)
    results: list = []
    store.bind(results.append)
    load.bind(results.append)
    try:
        slots = random.Random(page).sample(range(n), n) if order == "scattered" else list(range(n))
        per_job = max(1, job_bytes // page)
        cuts = range(0, n, per_job)
        stores = [(GPULoadStoreSpec(range(a, min(n, a + per_job))), CPULoadStoreSpec(slots[a:a + per_job]))
                  for a in cuts]
        loads = [(c, g) for g, c in stores]
        best_store = best_load = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            best_store = min(best_store, run_jobs(store, stores, results))
            engine.zero_()
            torch.cuda.synchronize()
            best_load = min(best_load, run_jobs(load, loads, results))
            if not torch.equal(engine, original):
                raise RuntimeError(f"{mode} {page} B pages: the loaded bytes differ from the stored ones")
        chosen = store.fast_path()
        row = {"page": page, "slots": order, "mode": mode, "path": chosen.name if chosen is not None else "staged",
               "jobs": len(stores), "threads": threads, "d2h_gbps": total / best_store / 1e9,
               "h2d_gbps": total / best_load / 1e9}
        if both and len(stores) >= 2:
            half = len(stores) // 2
            moved = sum(len(g.block_ids) for g, _ in stores[:half]) + sum(len(g.block_ids) for _, g in loads[half:])
            seconds = both_at_once(torch, store, load, stores, loads, results, engine, original, repeats)
            row["both_gbps"] = moved * page / seconds / 1e9
        return row
    finally:
        store.shutdown()
        load.shutdown()
        backend.close()


def copy_choice() -> dict:
    """Every copy-mechanism decision this process made: chosen path and each candidate's figures."""
    from kvtier.transfer.handlers import fast_path

    return {f"{key[0]} pages {list(key[1])}" if isinstance(key, tuple) else str(key): {
        "chosen": d.chosen.name if d.chosen is not None else "staged",
        "timings": {name: t.as_dict() for name, t in d.timings}, "left_out": d.failures}
        for key, d in fast_path.CHOICE.decisions().items()}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, metavar="FILE")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--pages", default="64KiB,256KiB,2MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job-mib", type=int, default=JOB_BYTES >> 20, help="bytes per job, MiB")
    parser.add_argument("--modes", default=",".join(MODES), help="copy paths to measure (comma-separated)")
    parser.add_argument("--threads", default="2", help="job threads per handler, one or several (comma-separated)")
    parser.add_argument("--slots", default="scattered,consecutive", help="slot orders to measure")
    parser.add_argument("--no-both", action="store_true", help="leave out both directions at once")
    parser.add_argument("--plan-only", action="store_true", help="the host work of a job only (no GPU needed)")
    parser.add_argument("--layers", default="1,32", help="--plan-only: KV tensors a block is split over")
    parser.add_argument("--blocks", type=int, default=256, help="--plan-only: engine blocks per job")
    args = parser.parse_args(argv)
    if set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes {args.modes!r}: use any of {', '.join(MODES)} (comma-separated)")
    if set(args.slots.split(",")) - {"scattered", "consecutive"}:
        parser.error(f"--slots {args.slots!r}: use scattered, consecutive or both (comma-separated)")
    from kvtier.config import parse_size

    try:
        args.page_sizes = [parse_size(p.strip()) for p in args.pages.split(",")]
    except ValueError as exc:
        parser.error(f"--pages {args.pages!r}: {exc}")
    return args


def plan_only(args) -> int:
    import platform

    import torch
    from bench_gpu_copy_plan import plan_rows

    rows = plan_rows(args.page_sizes, [int(n) for n in args.layers.split(",")], args.blocks, args.slots.split(","))
    from kvtier.bench.provenance import provenance

    doc = {**provenance(), "mode": "plan-only", "cpu": platform.processor() or platform.machine(),
           "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "rows": rows}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"written {args.json}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan_only:
        return plan_only(args)
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA (torch.cuda.is_available() is False)")
        return 2
    total = args.total_mib << 20
    d2h, h2d, both = contiguous_gbps(torch, total, args.repeats)
    rows = []
    for page in args.page_sizes:
        for order, mode, threads in [(o, m, int(t)) for o in args.slots.split(",") for m in args.modes.split(",")
                                     for t in args.threads.split(",")]:
            try:
                row = measure(torch, page, total, mode, args.repeats, order, args.job_mib << 20, threads,
                              not args.no_both)
            except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
                row = {"page": page, "slots": order, "mode": mode, "threads": threads,
                       "error": f"{type(exc).__name__}: {exc}"}
            if "error" not in row:
                row["d2h_ratio"], row["h2d_ratio"] = row["d2h_gbps"] / d2h, row["h2d_gbps"] / h2d
                if "both_gbps" in row:
                    row["both_ratio"] = row["both_gbps"] / max(d2h, h2d)
            rows.append(row)
            print(json.dumps(row), flush=True)
    from kvtier.bench.provenance import provenance

    doc = {**provenance(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cuda": torch.version.cuda,
           "total_bytes": total, "contiguous_d2h_gbps": d2h, "contiguous_h2d_gbps": h2d,
           "contiguous_both_gbps": both, "copy_choice": copy_choice(), "rows": rows}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"contiguous pinned copy: D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s, both at once {both:.1f} GB/s; "
          f"written {args.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
