"""Runs every hop measurement this machine supports, each next to its same-run baseline.

Rows: {"hop", "block_bytes", "gbps", "baseline", "baseline_gbps", ...}. GPU<->CPU hops use the
engine's KV cache on CUDA when available, else CPU tensors (the engine's cache on vLLM's CPU
platform); CPU<->FILE hops use a file tier in `root_dir` (default: a temporary directory);
CPU<->REMOTE hops, for each `valkey` tier of the config, its server (single-node URLs).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

QUICK_SIZES = [64 << 10, 1 << 20]
FULL_SIZES = [64 << 10, 256 << 10, 1 << 20, 2 << 20, 8 << 20]


def default_block_sizes(quick: bool) -> list[int]:
    return list(QUICK_SIZES if quick else FULL_SIZES)


def _engine_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no torch: no engine-side hops
        return "none"


def run_hops(config: Any, block_sizes: list[int], root_dir: str | None = None, quick: bool = False,
             progress: Callable | None = None) -> list[dict[str, Any]]:
    """Measure engine<->CPU and CPU<->FILE for each block size."""
    rows: list[dict[str, Any]] = []
    total = (16 << 20) if quick else (128 << 20)
    device = _engine_device()
    if device != "none":
        from kvtier.bench.hops import measure_gpu_cpu

        update = progress(f"engine({device})<->CPU") if progress else None
        rows += measure_gpu_cpu(device, block_sizes, total, progress=update)
    from kvtier.bench.file_hops import measure_cpu_file

    tmp = None
    if root_dir is None:
        tmp = root_dir = tempfile.mkdtemp(prefix="kvtier-bench-", dir=_file_tier_parent(config))
    try:
        update = progress("CPU<->FILE") if progress else None
        for i, size in enumerate(block_sizes):
            # Medians of 3 even when quick: one ~100 ms stall of the disk (seen here) would
            # otherwise decide a 16 MiB figure.
            figures = measure_cpu_file(root_dir, size, max(total, 8 * size), repeats=3)
            rows += file_rows(figures)
            if update:
                update(i + 1, len(block_sizes))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rows += _remote_rows(config, block_sizes, total, progress)
    return rows


def _remote_rows(config: Any, block_sizes: list[int], total: int, progress: Callable | None) -> list[dict[str, Any]]:
    """CPU<->REMOTE rows for each `valkey` tier of the config (on its server, under a bench prefix)."""
    rows: list[dict[str, Any]] = []
    for tier in config.tiers:
        if tier.backend != "valkey":
            continue
        from kvtier.bench.remote_hops import measure_cpu_remote, remote_rows

        options = dict(tier.options)
        update = progress(f"CPU<->REMOTE ({tier.name})") if progress else None
        for i, size in enumerate(block_sizes):
            figures = measure_cpu_remote(options, size, max(total, 8 * size))
            if figures is not None:
                rows += remote_rows(figures, options["url"])
            if update:
                update(i + 1, len(block_sizes))
    return rows


def hop_label(row: dict[str, Any]) -> str:
    """A hop's display name: 'GPU' becomes 'engine' when the engine's KV cache is in CPU memory."""
    return row["hop"].replace("GPU", "engine") if row.get("device") == "cpu" else row["hop"]


def file_rows(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The two hop rows (store, load) of one `measure_cpu_file` result, with its raw baselines."""
    common = {"block_bytes": figures["block_bytes"], "total_bytes": figures["total_bytes"], "io": figures["io"],
              "o_direct": figures["o_direct"]}
    return [
        {"hop": "CPU->FILE", **common, "gbps": figures["store_gbps"], "baseline": "raw O_DIRECT write",
         "baseline_gbps": figures["raw_write_gbps"], "first_fill_gbps": figures["store_first_fill_gbps"],
         "raw_first_fill_gbps": figures["raw_first_fill_gbps"]},
        {"hop": "FILE->CPU", **common, "gbps": figures["load_gbps"], "baseline": "raw O_DIRECT read",
         "baseline_gbps": figures["raw_read_gbps"]},
    ]


def _file_tier_parent(config: Any) -> str | None:
    """Measure on the filesystem the config's file tier would use: the nearest existing, writable
    directory on the way to its root_dir (the tier may not have been built yet)."""
    import os

    for tier in config.tiers:
        root = dict(tier.options).get("root_dir")
        if root:
            parent = os.path.dirname(os.path.abspath(root))
            while not os.path.isdir(parent) and parent != os.path.dirname(parent):
                parent = os.path.dirname(parent)
            if os.access(parent, os.W_OK):
                return parent
    return None


def run_jobs(handler, jobs: list[tuple], then=None) -> tuple[float, list]:
    """Submit every (src, dst) job at once, wait for all, call `then()` if given (inside the
    timing); returns (seconds, results)."""
    results: list = []
    done = threading.Condition()

    def on_done(result):
        with done:
            results.append(result)
            done.notify_all()

    handler.bind(on_done)
    start = time.perf_counter()
    for job_id, (src, dst) in enumerate(jobs):
        handler.submit(job_id, src, dst)
    with done:
        done.wait_for(lambda: len(results) == len(jobs))
    if then is not None:
        then()
    return time.perf_counter() - start, results
