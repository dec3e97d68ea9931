"""CPU <-> FILE hop bandwidth through the handlers vs a raw O_DIRECT baseline, and restart time.

`measure_cpu_file(root_dir, block_bytes, total_bytes)` (used by `kvtier bench hops`): stores
`total_bytes` of random blocks (at most `MAX_HOP_BLOCKS` blocks, `kvtier.bench.hops`) from a memory
tier into a fresh file tier through `CPUToFileHandler` (jobs of `job_blocks` blocks, all submitted
at once, timed until the last job completed and the tier's `sync()` made everything durable;
timed twice: first fill of the preallocated slab, then again over the same slots = steady state),
loads them back through `FileToCPUHandler` (verified, byte-compared), then writes (fresh file, then
overwrite) and reads the same bytes (the source blocks' own memory) with O_DIRECT in `RUN_BYTES`
I/Os (at most IOV_MAX iovecs each; blocks that are not whole pages are first copied into one
page-aligned buffer, outside the timing) + fdatasync, once on one thread and once on `num_threads`
threads (the raw baseline is the better of the two) in the same run. GB/s = 1e9 bytes per second.

`measure_restart(root_dir, num_blocks, block_bytes)`: fills a file tier of `num_blocks` blocks,
closes it, and times opening it again until its blocks are ready to serve (`recover()`), and a
whole hierarchy (memory tier over that file tier) built from YAML.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.hops import TransferCorrupted, hop_blocks
from kvtier.bench.hops_runner import run_jobs
from kvtier.config import DEFAULT_BLOCK_TOKENS
from kvtier.core.keys import OffloadKey, make_offload_key
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.tiers.file.backend import RUN_BYTES, FileBackend
from kvtier.tiers.file.fileio import ALIGN, aligned_buffer, buffer_address
from kvtier.tiers.file.spec import FileLoadStoreSpec
from kvtier.tiers.memory import MemoryBackend
from kvtier.transfer.handlers.cpu_file import CPUToFileHandler, FileToCPUHandler

BENCH_MODEL = "kvtier-bench"  # the identity of the bench's file tiers: they hold random bytes, no model's KV
BENCH_TOKENS = DEFAULT_BLOCK_TOKENS  # tokens per block recorded in the bench's file tiers


def _key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big") * 4, 0)


def iov_max() -> int:
    """The most iovecs one preadv/pwritev takes (IOV_MAX; 1024 on Linux)."""
    try:
        return max(1, os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError):
        return 1024


def io_views(views: list[memoryview], block_bytes: int) -> tuple[list[list[memoryview]], Callable[[], None]]:
    """The O_DIRECT I/Os (lists of at most IOV_MAX iovecs, about RUN_BYTES each) covering `views`
    back to back.

    Page-aligned views of whole pages are used as they are (the shared-memory CPU tier: the very
    bytes the handler moves); anything else is first copied into one page-aligned buffer. Returns
    (I/Os, release: frees that buffer once the I/Os are done)."""
    aligned = block_bytes % ALIGN == 0 and all(buffer_address(v) % ALIGN == 0 for v in views)
    if aligned:
        per_io = max(1, min(iov_max(), RUN_BYTES // block_bytes))
        return [views[i:i + per_io] for i in range(0, len(views), per_io)], lambda: None
    total = len(views) * block_bytes
    copy = aligned_buffer(total)
    image = memoryview(copy)
    for i, view in enumerate(views):
        image[i * block_bytes:(i + 1) * block_bytes] = view
    padded = -(-total // ALIGN) * ALIGN
    ios = [[image[o:min(o + RUN_BYTES, padded)]] for o in range(0, padded, RUN_BYTES)]

    def release() -> None:  # every view of the mapping first: a mapping with views cannot close
        for io in ios:
            for view in io:
                view.release()
        image.release()
        copy.close()
    return ios, release


def raw_direct(path: Path, sources: list[memoryview], dests: list[memoryview], block_bytes: int,
                threads: int) -> tuple[float, float, float]:
    """Raw O_DIRECT baseline on the same bytes the handler moves: write `sources` (one view per
    block) back to back into a fresh file (+ fdatasync), write them again (overwrite), then read
    the file into `dests`; I/Os of about RUN_BYTES, sequential offsets spread over `threads`
    threads (1 = queue depth 1). Returns (first-fill s, overwrite s, read s)."""
    from concurrent.futures import ThreadPoolExecutor

    writes, release_w = io_views(sources, block_bytes)
    reads, release_r = io_views(dests, block_bytes)
    offsets = [0]
    for io in writes[:-1]:
        offsets.append(offsets[-1] + sum(v.nbytes for v in io))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)

    def run(t: int, op, ios) -> None:
        for i in range(t, len(ios), threads):
            op(fd, ios[i], offsets[i])

    try:
        os.posix_fallocate(fd, 0, offsets[-1] + sum(v.nbytes for v in writes[-1]))
        with ThreadPoolExecutor(threads) as pool:
            write_s = []
            for _ in range(2):
                start = time.perf_counter()
                list(pool.map(run, range(threads), [os.pwritev] * threads, [writes] * threads))
                os.fdatasync(fd)
                write_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            list(pool.map(run, range(threads), [os.preadv] * threads, [reads] * threads))
            read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        release_w()
        release_r()
    return write_s[0], write_s[1], read_s


def _check_jobs(hop: str, results: list) -> None:
    failed = [r.error for r in results if not r.success]
    if failed:
        raise TransferCorrupted(f"{hop}: {len(failed)} of {len(results)} jobs failed ({failed[0]})")


def _store_load_once(work: Path, mem, n: int, block_bytes: int, io: str, num_threads: int,
                     job_blocks: int) -> tuple[float, float, float, str, bool]:
    """Store into a fresh file tier (first fill), store again (overwrite: slots reused, the steady
    state of a cache), load back, through the handlers; returns (fill s, store s, load s, io_name, direct)."""
    disk = FileBackend("disk", n, block_bytes, BENCH_TOKENS, root_dir=str(work / "tier"), io=io,
                       num_threads=num_threads, fingerprint=BENCH_MODEL)
    handlers = [CPUToFileHandler({"mem": mem}, {"disk": disk}, num_threads),
                FileToCPUHandler({"mem": mem}, {"disk": disk}, num_threads)]
    try:
        batches = [list(range(s, min(n, s + job_blocks))) for s in range(0, n, job_blocks)]
        stores = [(CPULoadStoreSpec(b, tier="mem"), FileLoadStoreSpec(b, [_key(i) for i in b], tier="disk"))
                  for b in batches]
        # Timed until durable (the raw baseline ends with fdatasync too).
        fill_s, results = run_jobs(handlers[0], stores, then=disk.sync)
        _check_jobs("CPU->FILE", results)
        store_s, results = run_jobs(handlers[0], stores, then=disk.sync)
        _check_jobs("CPU->FILE", results)
        loads = [(FileLoadStoreSpec(b, [_key(i) for i in b], tier="disk"),
                  CPULoadStoreSpec([n + i for i in b], tier="mem")) for b in batches]
        load_s, results = run_jobs(handlers[1], loads)
        _check_jobs("FILE->CPU", results)
        for i in range(n):
            if mem.view(n + i) != mem.view(i):
                raise TransferCorrupted(f"FILE->CPU with {block_bytes}-byte blocks read block {i} back wrong: a "
                                        f"defect of the file tier's handlers, not a figure (please report it)")
            mem.view(n + i)[:1] = b"\xff" if mem.view(i)[0] != 0xFF else b"\0"  # next round must rewrite it
        return fill_s, store_s, load_s, disk.io.name, disk.io.direct
    finally:
        for h in handlers:
            h.shutdown()
        disk.close()
        shutil.rmtree(work / "tier", ignore_errors=True)


def _host_backend(host: str, num_blocks: int, block_bytes: int) -> Any:
    """The CPU side of the hop: the shared-memory CPU tier (`cpu`) or the in-process memory tier."""
    if host == "cpu":
        from kvtier.tiers.cpu import CPUBackend

        return CPUBackend("mem", num_blocks, block_bytes, pin="false")
    return MemoryBackend("mem", num_blocks, block_bytes)


def _alternating_rounds(work: Path, mem, n: int, block_bytes: int, io: str, num_threads: int, job_blocks: int,
                        repeats: int, runs: dict[str, list[float]]) -> tuple[str, bool]:
    """`repeats` handler rounds and raw rounds, alternating which goes first, each round's seconds
    appended to `runs`; blocks 0..n-1 of `mem` are the sources, n..2n-1 the destinations.
    Returns (the name of the file tier's `BlockIO`, whether it used O_DIRECT)."""
    sources = [mem.view(i) for i in range(n)]
    dests = [mem.view(n + i) for i in range(n)]

    def handler_round() -> tuple[str, bool]:
        fill_s, store_s, load_s, io_name, direct = _store_load_once(work, mem, n, block_bytes, io, num_threads,
                                                                     job_blocks)
        runs["fill"].append(fill_s)
        runs["store"].append(store_s)
        runs["load"].append(load_s)
        return io_name, direct

    def raw_round() -> None:
        for tag, threads in (("1", 1), ("t", num_threads)):
            f, w, r = raw_direct(work / "raw", sources, dests, block_bytes, threads)
            for view in dests:  # the handler's next load must rewrite them to pass its check
                view[:1] = b"\xff" if view[0] != 0xFF else b"\0"
            os.unlink(work / "raw")
            runs["f" + tag].append(f)
            runs["w" + tag].append(w)
            runs["r" + tag].append(r)

    for i in range(repeats):
        # Alternate which side goes first: the disk is still busy with the previous side's
        # writes (and the deleted raw file's extents) when the next one starts.
        if i % 2 == 0:
            io_name, direct = handler_round()
            raw_round()
        else:
            raw_round()
            io_name, direct = handler_round()
    return io_name, direct


def _cpu_file_figures(runs: dict[str, list[float]], total: int, num_threads: int) -> dict[str, Any]:
    """GB/s (of the median round) per measurement, and the handler's ratios to the better raw run."""
    from statistics import median

    gb = total / 1e9
    rate = {k: gb / median(v) for k, v in runs.items()}
    figures: dict[str, Any] = {
        "store_gbps": rate["store"], "store_first_fill_gbps": rate["fill"], "load_gbps": rate["load"],
        "raw_write_gbps_qd1": rate["w1"], "raw_first_fill_gbps_qd1": rate["f1"], "raw_read_gbps_qd1": rate["r1"],
        f"raw_write_gbps_{num_threads}t": rate["wt"], f"raw_first_fill_gbps_{num_threads}t": rate["ft"],
        f"raw_read_gbps_{num_threads}t": rate["rt"],
    }
    # The baseline is the better of the two raw runs, so the ratio is never flattered.
    figures["raw_write_gbps"] = max(rate["w1"], rate["wt"])
    figures["raw_first_fill_gbps"] = max(rate["f1"], rate["ft"])
    figures["raw_read_gbps"] = max(rate["r1"], rate["rt"])
    figures["store_vs_raw"] = figures["store_gbps"] / figures["raw_write_gbps"]
    figures["first_fill_vs_raw"] = figures["store_first_fill_gbps"] / figures["raw_first_fill_gbps"]
    figures["load_vs_raw"] = figures["load_gbps"] / figures["raw_read_gbps"]
    return figures


def measure_cpu_file(root_dir: str, block_bytes: int, total_bytes: int, *, io: str = "posix",
                     num_threads: int = 4, job_blocks: int = 16, repeats: int = 3, host: str = "cpu") -> dict:
    """Store/load bandwidth of the CPU<->FILE hop vs raw O_DIRECT (see module docstring).

    Handler and raw runs alternate `repeats` times on fresh files; figures are medians (the disk
    is shared and noisy). `host` is the CPU side: `cpu` (the shared-memory CPU tier) or `memory`
    (the in-process memory tier); both have page-aligned slots, so file I/O is zero-copy. Uses and removes
    a fresh `root_dir/kvtier-bench-XXXXXXXX` (mkdtemp: a name planted in a shared `root_dir`
    such as /tmp is never used). `seconds` holds every round's seconds per measurement (handler:
    `fill`, `store`, `load`; raw on one thread: `f1`, `w1`, `r1`, on `num_threads`: `ft`, `wt`, `rt`).
    Raises TransferCorrupted if a job fails or a block reads back wrong.
    """
    n = hop_blocks(block_bytes, total_bytes)
    total = n * block_bytes
    mem = _host_backend(host, 2 * n, block_bytes)
    runs: dict[str, list[float]] = {k: [] for k in ("fill", "store", "load", "f1", "w1", "r1", "ft", "wt", "rt")}
    work = None
    try:  # the directory only once the CPU side exists: a region that does not fit leaves nothing behind
        work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=root_dir))  # 0700, a fresh name: nothing planted
        noise = os.urandom(block_bytes + 4096)
        for i in range(n):  # distinct content per block
            mem.view(i)[:] = noise[i % 4096:i % 4096 + block_bytes]
        io_name, direct = _alternating_rounds(work, mem, n, block_bytes, io, num_threads, job_blocks, repeats, runs)
    finally:
        mem.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return {"block_bytes": block_bytes, "total_bytes": total, "host": host, "io": io_name, "o_direct": direct,
            "num_threads": num_threads, "job_blocks": job_blocks, "repeats": repeats, "seconds": runs,
            **_cpu_file_figures(runs, total, num_threads)}


def measure_restart(root_dir: str, num_blocks: int = 100_000, block_bytes: int = 3584, rewrites: int = 1) -> dict:
    """Seconds from opening a full file tier of `num_blocks` blocks to blocks ready to serve.

    Every block is written `1 + rewrites` times, so the journal holds that many records per block
    (1 rewrite = 2 x capacity, the most it holds before it is compacted: the worst case)."""
    from kvtier import build_hierarchy, load_config_text

    work = Path(tempfile.mkdtemp(prefix="kvtier-restart-", dir=root_dir))
    tier = work / "tier"
    try:
        disk = FileBackend("disk", num_blocks, block_bytes, BENCH_TOKENS, root_dir=str(tier), io="posix",
                           fingerprint=BENCH_MODEL)
        batch = max(1, RUN_BYTES // disk.slot_bytes) * 4
        payload = bytes(block_bytes)
        start = time.perf_counter()
        for _ in range(1 + rewrites):
            for s in range(0, num_blocks, batch):
                slots = list(range(s, min(num_blocks, s + batch)))
                disk.write_blocks(slots, [_key(i) for i in slots], [payload] * len(slots))
        records = disk.journal.records
        fill_s = time.perf_counter() - start
        disk.close()
        start = time.perf_counter()
        disk = FileBackend("disk", num_blocks, block_bytes, BENCH_TOKENS, root_dir=str(tier), io="posix",
                           fingerprint=BENCH_MODEL)
        found = disk.recover()
        backend_s = time.perf_counter() - start
        disk.close()
        assert len(found) == num_blocks, len(found)
        config = load_config_text(f"""
block_bytes: {block_bytes}B
block_tokens: {BENCH_TOKENS}
tiers:
  - {{name: mem, backend: memory, capacity: 1024 blocks}}
  - {{name: disk, backend: file, root_dir: {json.dumps(str(tier))}, capacity: {num_blocks} blocks, io: posix}}
""")
        start = time.perf_counter()
        hierarchy = build_hierarchy(config, model=BENCH_MODEL)
        hierarchy_s = time.perf_counter() - start
        resident = hierarchy.manager.get_stats()["disk"]["resident_blocks"]
        hierarchy.close()
        assert resident == num_blocks, resident
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"num_blocks": num_blocks, "block_bytes": block_bytes, "journal_records": records, "fill_s": fill_s,
            "backend_ready_s": backend_s, "hierarchy_ready_s": hierarchy_s}


def main(argv: list[str] | None = None) -> int:
    """`python -m kvtier.bench.file_hops [ROOT_DIR] [--repeats N]`: JSON lines of figures on stdout."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.file_hops", description=__doc__.split("\n\n")[0])
    parser.add_argument("root_dir", nargs="?", default="/tmp",
                        help="an existing, writable directory on the filesystem to measure (default: /tmp)")
    parser.add_argument("repeats_pos", nargs="?", type=int, metavar="REPEATS", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help="handler/raw rounds per block size (default: 5)")
    args = parser.parse_args(argv)
    repeats = args.repeats_pos or args.repeats
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    from kvtier.bench.where import RootDirError, check_root_dir

    try:
        where = check_root_dir(args.root_dir)
    except RootDirError as exc:
        parser.error(str(exc))
    for size in (1 << 20, 2 << 20, 8 << 20):
        figures = measure_cpu_file(where, size, 512 << 20, repeats=repeats)
        print(f"{size >> 20} MiB: store {figures['store_gbps']:.2f} GB/s = {figures['store_vs_raw']:.0%} of raw "
              f"{figures['raw_write_gbps']:.2f}; load {figures['load_gbps']:.2f} GB/s = {figures['load_vs_raw']:.0%} "
              f"of raw {figures['raw_read_gbps']:.2f}", file=sys.stderr)
        print(json.dumps(figures))
    print(json.dumps(measure_restart(where)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
