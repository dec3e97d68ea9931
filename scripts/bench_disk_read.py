#!/usr/bin/env python
"""The floor under a file-tier reload: how long reading one prompt's blocks takes on this disk.

    python scripts/bench_disk_read.py [--mib 40] [--dir /tmp] [--out bench_disk_read.json]

Writes a file of `--mib` MiB of random bytes under `--dir`, then reads it back whole, median of 7:
with O_DIRECT (as kvtier's file tier and vLLM's fs tier read, the disk's bandwidth) in I/Os of
1-40 MiB on 1-16 threads, and buffered, one I/O (twice, after dropping the file's pages from the
page cache: the first read comes from the disk, the second is a copy out of the page cache). On a
virtual disk the host may cache what the O_DIRECT reads just read: the first buffered read can then
beat them (25 against 40 ms here, where one on its own took 41 ms). Prints the table and writes
JSON. Linux only (O_DIRECT).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SHAPES = [(40, 1), (8, 4), (4, 4), (4, 8), (2, 8), (1, 8), (1, 16)]  # (I/O MiB, threads)


def _read_all(fd: int, view: memoryview, size: int, chunk: int, pool: ThreadPoolExecutor) -> float:
    parts = [(offset, min(chunk, size - offset)) for offset in range(0, size, chunk)]
    start = time.perf_counter()
    done = list(pool.map(lambda p: os.preadv(fd, [view[p[0]:p[0] + p[1]]], p[0]), parts))
    elapsed = time.perf_counter() - start
    if sum(done) != size:
        raise OSError(f"read {sum(done)} of {size} bytes")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=40)
    parser.add_argument("--dir", default=None, help="where to write the file (default: the temp dir)")
    parser.add_argument("--out", default="bench_disk_read.json")
    args = parser.parse_args()
    size = args.mib << 20
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "blocks"
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
        buffer = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        view = memoryview(buffer)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for mib, threads in SHAPES:
                with ThreadPoolExecutor(threads) as pool:
                    secs = [_read_all(fd, view, size, min(mib, args.mib) << 20, pool) for _ in range(7)]
                rows.append({"mode": "O_DIRECT", "io_mib": mib, "threads": threads,
                             "median_ms": 1e3 * statistics.median(secs)})
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written and synced: its pages are clean
            with ThreadPoolExecutor(1) as pool:
                for label in ("buffered, first", "buffered, again"):
                    rows.append({"mode": label, "io_mib": args.mib, "threads": 1,
                                 "median_ms": 1e3 * _read_all(fd, view, size, size, pool)})
        finally:
            os.close(fd)
        del view
        buffer.close()
    print(f"reading {args.mib} MiB under {args.dir or tempfile.gettempdir()}")
    for row in rows:
        print(f"{row['mode']:<16} I/O {row['io_mib']:>3} MiB x {row['threads']:>2} threads: {row['median_ms']:7.1f} ms")
    from kvtier.bench.provenance import provenance

    Path(args.out).write_text(json.dumps({**provenance(), "mib": args.mib, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
