"""Engine <-> CPU tier on CUDA with scattered slots (a cache after churn), against one contiguous
pinned copy of the same bytes: GB/s and ratio per page size, direction and copy path.

    python scripts/bench_gpu_copy.py --json OUT.json [--total-mib 512] [--pages 64KiB,256KiB,2MiB]
                                     [--slots scattered,consecutive] [--job-mib 16] [--repeats 3]
                                     [--modes staged,auto,...] [--threads 2[,4,...]]

Each measurement moves `--total-mib` through the real handlers (`make_handler` over a pinned
`CPUBackend`), in jobs of 16 MiB (256 blocks of 64 KiB, 16 of 2 MiB, as vLLM submits them),
slots a random permutation (and, for comparison, consecutive); best of `--repeats`. Paths:
`staged` (the bounce path), `auto` (the fast path the self-check chose, named in the JSON), and
`batch`, `bindings` and `loop` each alone (`KVTIER_GPU_COPY`; `--modes` picks some);
`--job-mib` sets the job size, `--threads` the handlers' job threads. Every load is checked byte
for byte against the engine's bytes before the store.
Exits 2 with "skipped: no CUDA" where torch sees no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

JOB_BYTES = 16 << 20
MODES = ("staged", "auto", "batch", "bindings", "loop")


def contiguous_gbps(torch, nbytes: int, repeats: int) -> tuple[float, float]:
    """(device->host, host->device) GB/s of one copy between a device buffer and pinned memory."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out.append(nbytes / best / 1e9)
    return out[0], out[1]


def run_jobs(handler, jobs, results) -> float:
    """Submit every job, wait for all; seconds taken. Raises if a job failed."""
    start = time.perf_counter()
    for job_id, (src, dst) in enumerate(jobs):
        handler.submit(job_id, src, dst)
    handler.wait(range(len(jobs)))
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"job {failed[0].job_id} failed: {failed[0].error}")
    results.clear()
    return elapsed


def measure(torch, page: int, total: int, mode: str, repeats: int, order: str,
            job_bytes: int = JOB_BYTES, threads: int = 2) -> dict:
    from kvtier import CanonicalKVCaches, CanonicalKVCacheTensor, CPULoadStoreSpec, GPULoadStoreSpec
    from kvtier.handlers import fast_path
    from kvtier.handlers.gpu_cpu import make_handler
    from kvtier.tiers.cpu import CPUBackend

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
        return {"page": page, "slots": order, "mode": mode, "path": chosen.name if chosen is not None else "staged",
                "jobs": len(stores), "threads": threads, "d2h_gbps": total / best_store / 1e9,
                "h2d_gbps": total / best_load / 1e9}
    finally:
        store.shutdown()
        load.shutdown()
        backend.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, metavar="FILE")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--pages", default="64KiB,256KiB,2MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job-mib", type=int, default=JOB_BYTES >> 20, help="bytes per job, MiB")
    parser.add_argument("--modes", default=",".join(MODES), help="copy paths to measure (comma-separated)")
    parser.add_argument("--threads", default="2", help="job threads per handler, one or several (comma-separated)")
    parser.add_argument("--slots", default="scattered,consecutive", help="slot orders to measure")
    args = parser.parse_args(argv)
    if set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes {args.modes!r}: use any of {', '.join(MODES)} (comma-separated)")
    if set(args.slots.split(",")) - {"scattered", "consecutive"}:
        parser.error(f"--slots {args.slots!r}: use scattered, consecutive or both (comma-separated)")
    from kvtier.config import parse_size

    try:
        pages = [parse_size(p.strip()) for p in args.pages.split(",")]
    except ValueError as exc:
        parser.error(f"--pages {args.pages!r}: {exc}")
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA (torch.cuda.is_available() is False)")
        return 2
    total = args.total_mib << 20
    d2h, h2d = contiguous_gbps(torch, total, args.repeats)
    rows = []
    for page in pages:
        for order, mode, threads in [(o, m, int(t)) for o in args.slots.split(",") for m in args.modes.split(",")
                                     for t in args.threads.split(",")]:
            try:
                row = measure(torch, page, total, mode, args.repeats, order, args.job_mib << 20, threads)
            except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
                row = {"page": page, "slots": order, "mode": mode, "threads": threads,
                       "error": f"{type(exc).__name__}: {exc}"}
            if "error" not in row:
                row["d2h_ratio"], row["h2d_ratio"] = row["d2h_gbps"] / d2h, row["h2d_gbps"] / h2d
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "total_bytes": total, "contiguous_d2h_gbps": d2h, "contiguous_h2d_gbps": h2d, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"contiguous pinned copy: D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s; written {args.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
