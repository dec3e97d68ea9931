"""Where the ceiling of the engine <-> pinned CPU hop is: the copy mechanisms alone, without
kvtier's handlers (no job threads, no events per job, no plan building), on the scattered layout
`scripts/bench_gpu_copy.py` measures through the handlers.

    python scripts/bench_gpu_copy_ceiling.py --json OUT.json [--total-mib 512] [--pages 64KiB,256KiB,2MiB]

For each page size: `--total-mib` of device pages, each copied to (then back from) a slot of a
pinned host buffer, slots a random permutation, slot stride = page + 4 KiB (a slot header, as
the CPU tier has, so no two descriptors merge). Mechanisms, each both directions, best of
`--repeats`, every load checked byte for byte:

- `batch-stream-all`: one `cudaMemcpyBatchAsync` of every descriptor, srcAccessOrder Stream
  (kvtier's submitter, `kvtier.transfer.handlers.cuda_copy`);
- `batch-any-all`: the same with srcAccessOrder Any;
- `batch-stream-jobs`, `batch-any-jobs`: one call per 16 MiB job (`--job-mib`), back to back on
  one stream, one synchronisation at the end (what the handlers do, without their threads);
- `triton-<programs>`: a Triton kernel whose programs copy whole descriptors with 8-byte loads
  and stores through the host buffer's device-visible (UVA) address, for 16, 32 and 132
  programs (skipped where Triton does not import).

Times are wall clock from the first submission to the stream's end (host submission included);
`submit_ms` is the submission alone. Ratios are to one contiguous pinned copy of the same bytes.
Exits 2 with "skipped: no CUDA" where torch sees no GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

SLOT_HEADER = 4096


def contiguous_s(torch, nbytes: int, repeats: int) -> tuple[float, float]:
    """Best seconds of one contiguous device->pinned and pinned->device copy of `nbytes`."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        best.append(min(times))
    return best[0], best[1]


def triton_copier():
    """A function copy(src, dst, size, programs, stream) running the Triton kernel, or None."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_descriptors(srcs, dsts, sizes, n, WORDS: tl.constexpr):
        program = tl.program_id(0)
        lanes = tl.arange(0, WORDS)
        i = program
        while i < n:
            src = tl.load(srcs + i).to(tl.pointer_type(tl.int64))
            dst = tl.load(dsts + i).to(tl.pointer_type(tl.int64))
            words = tl.load(sizes + i) // 8
            for first in range(0, words, WORDS):
                at = first + lanes
                keep = at < words
                tl.store(dst + at, tl.load(src + at, mask=keep, other=0), mask=keep)
            i += tl.num_programs(0)

    def copy(src, dst, size, programs: int) -> None:
        copy_descriptors[(programs,)](src, dst, size, src.numel(), WORDS=1024)

    return copy


def measure(torch, page: int, total: int, repeats: int, job_bytes: int, triton_copy) -> list[dict]:
    import numpy as np

    from kvtier.transfer.handlers import cuda_copy
    from kvtier.transfer.handlers.copy_plan import CopyPlan

    n = total // page
    engine = torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda")
    original = engine.clone()
    stride = page + SLOT_HEADER
    host = torch.zeros(n * stride, dtype=torch.uint8, pin_memory=True)
    slots = np.array(random.Random(page).sample(range(n), n), dtype=np.int64)
    dev_addr = engine.data_ptr() + np.arange(n, dtype=np.int64) * page
    host_addr = host.data_ptr() + SLOT_HEADER + slots * stride
    size = np.full(n, page, dtype=np.int64)
    per_job = max(1, job_bytes // page)
    stream = torch.cuda.Stream()
    submitters = {"stream": cuda_copy.make_c_batch_submitter(cuda_copy.SRC_ACCESS_ORDER_STREAM),
                  "any": cuda_copy.make_c_batch_submitter(cuda_copy.SRC_ACCESS_ORDER_ANY)}

    def batch(order: str, per: int):
        def run(src, dst):
            for a in range(0, n, per):
                submitters[order].submit(CopyPlan(src[a:a + per], dst[a:a + per], size[a:a + per]),
                                         stream.cuda_stream)
        return run

    mechanisms = {f"batch-{o}-{w}": batch(o, n if w == "all" else per_job)
                  for o in ("stream", "any") for w in ("all", "jobs")}
    if triton_copy is not None:
        on_device = {name: torch.from_numpy(a).to("cuda") for name, a in
                     (("dev", dev_addr), ("host", host_addr), ("size", size))}

        def kernel(programs: int):
            def run(src, dst):
                s, d = (on_device["dev"], on_device["host"]) if src is dev_addr else (on_device["host"],
                                                                                      on_device["dev"])
                with torch.cuda.stream(stream):
                    triton_copy(s, d, on_device["size"], programs)
            return run

        mechanisms.update({f"triton-{p}": kernel(p) for p in (16, 32, 132)})
    rows = []
    for name, run in mechanisms.items():
        row: dict = {"page": page, "mechanism": name, "descriptors": n}
        host.zero_()  # (a mechanism that stores nothing must not pass on an earlier one's bytes)
        try:
            for direction, (src, dst) in (("d2h", (dev_addr, host_addr)), ("h2d", (host_addr, dev_addr))):
                best, submit = float("inf"), float("inf")
                for _ in range(repeats):
                    if direction == "h2d":
                        engine.zero_()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    run(src, dst)
                    submitted = time.perf_counter()
                    stream.synchronize()
                    end = time.perf_counter()
                    best, submit = min(best, end - start), min(submit, submitted - start)
                if direction == "h2d" and not torch.equal(engine, original):
                    raise RuntimeError("the bytes loaded back differ from the stored ones")
                row[f"{direction}_s"], row[f"{direction}_submit_ms"] = best, submit * 1e3
        except Exception as exc:  # noqa: BLE001 - one failing mechanism must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, metavar="FILE")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--pages", default="64KiB,256KiB,2MiB")
    parser.add_argument("--job-mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from kvtier.config import parse_size

    pages = [parse_size(p.strip()) for p in args.pages.split(",")]
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA (torch.cuda.is_available() is False)")
        return 2
    total = args.total_mib << 20
    d2h, h2d = contiguous_s(torch, total, args.repeats)
    triton_copy = triton_copier()
    rows = [row for page in pages
            for row in measure(torch, page, total, args.repeats, args.job_mib << 20, triton_copy)]
    for row in rows:
        for direction, base in (("d2h", d2h), ("h2d", h2d)):
            if f"{direction}_s" in row:
                row[f"{direction}_gbps"] = total / row[f"{direction}_s"] / 1e9
                row[f"{direction}_ratio"] = base / row[f"{direction}_s"]
    from kvtier.bench.provenance import provenance

    doc = {**provenance(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "total_bytes": total,
           "contiguous_d2h_gbps": total / d2h / 1e9, "contiguous_h2d_gbps": total / h2d / 1e9,
           "triton": triton_copy is not None, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"contiguous: D2H {total / d2h / 1e9:.1f} GB/s, H2D {total / h2d / 1e9:.1f} GB/s")
    for row in rows:
        ratios = " ".join(f"{d} {row[d + '_gbps']:.1f} GB/s ({row[d + '_ratio']:.0%}, submit "
                          f"{row[d + '_submit_ms']:.2f} ms)" for d in ("d2h", "h2d") if d + "_gbps" in row)
        print(f"{row['page'] >> 10:>5} KiB {row['mechanism']:<18} {ratios or row.get('error')}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
