"""Runs every hop measurement this machine supports, each next to its same-run baseline.

Rows: {"hop", "block_bytes", "gbps", "baseline", "baseline_gbps", "ratio", "flags", ...} (medians
of `repeats` rounds, with every sample: `kvtier.bench.spread`). GPU<->CPU hops use the engine's KV
cache on CUDA when available, else CPU tensors (the engine's cache on vLLM's CPU platform), with
consecutive and scattered CPU slots; engine<->FILE hops its staged and (on CUDA with kvikio) direct
handler; CPU<->FILE hops use a fresh directory inside the place that
`kvtier.bench.where.file_hops_place` chose; CPU<->REMOTE hops, for each `valkey` tier of the
config, its server (single-node URLs), which must answer a PING before anything is measured.
Each measurement moves at most `MAX_HOP_BLOCKS` blocks (`kvtier.bench.hops`; engine<->CPU up to
`MAX_ENGINE_HOP_BLOCKS` blocks of a page or more): small blocks move fewer bytes than the default (a
note says so), so memory stays bounded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.bench.hops import hop_blocks
from kvtier.bench.spread import annotate, flag_baseline_jumps, last_level_cache_bytes

QUICK_SIZES = [64 << 10, 1 << 20]
FULL_SIZES = [64 << 10, 256 << 10, 1 << 20, 2 << 20, 8 << 20]
QUICK_ENGINE_BYTES = 40 << 20  # engine<->CPU bytes per copy, at least (more where the CPU cache is larger)
QUICK_FILE_BYTES = 16 << 20
FULL_BYTES = 128 << 20
CACHE_MARGIN = 8 << 20  # host copies move this much more than the last-level cache holds
MEMORY_SHARE = 8  # ... but at most this fraction of the available memory (four tensors of that size are held)


def default_block_sizes(quick: bool) -> list[int]:
    return list(QUICK_SIZES if quick else FULL_SIZES)


def engine_device() -> str:
    """Where the engine's KV cache is for the engine-side hops: "cuda", "cpu", or "none" (no torch)."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no torch: no engine-side hops
        return "none"


def engine_file_paths(device: str) -> tuple[list[str], str | None]:
    """The engine<->FILE handler paths measurable here, and why the others are not (or None)."""
    if device == "none":
        return [], "engine<->FILE not measured: torch is not importable"
    if device != "cuda":
        return ["staged"], ("engine<->FILE direct (kvikio) not measured: it serves a KV cache on CUDA, and the "
                            "engine's KV cache is in CPU tensors here")
    from kvtier.tiers.file.fileio import kvikio_importable

    if not kvikio_importable():
        return ["staged"], "engine<->FILE direct not measured: kvikio is not importable"
    return ["staged", "direct"], None


def run_hops(config: Any, block_sizes: list[int], place: dict[str, Any], quick: bool = False,
             progress: Callable | None = None, repeats: int = 3, notes: list[str] | None = None
             ) -> list[dict[str, Any]]:
    """Measure engine<->CPU, CPU<->FILE and engine<->FILE for each block size, `repeats` rounds
    each; the file hops in a fresh directory under `place["parent"]` (removed at the end). Lines
    saying what could not be measured here are appended to `notes`. A valkey tier whose server
    cannot be used raises `RemoteUnavailable` before anything is measured, or, when it fails
    later, with the rows measured before it in its `rows`."""
    from kvtier.bench.remote_hops import RemoteUnavailable, check_reachable

    for tier in valkey_tiers(config):  # a server that is down: said at once, not after the other hops
        check_reachable(tier.name, dict(tier.options))
    rows: list[dict[str, Any]] = []
    device = engine_device()
    total = QUICK_FILE_BYTES if quick else FULL_BYTES
    if notes is not None:
        notes += capped_note(block_sizes, total)
    if device != "none":
        from kvtier.bench.hops import measure_gpu_cpu

        update = progress(f"engine({device})<->CPU") if progress else None
        rows += measure_gpu_cpu(device, block_sizes, engine_hop_bytes(device, quick), progress=update,
                                repeats=repeats)
    rows += _file_rows(device, block_sizes, place, total, repeats, progress, notes)
    try:
        rows += remote_rows(config, block_sizes, total, progress)
    except RemoteUnavailable as exc:  # the rows measured before it, its tier's included, go with it
        rows += exc.rows
        flag_baseline_jumps(rows)
        exc.rows = rows
        raise
    flag_baseline_jumps(rows)
    return rows


def _file_rows(device: str, block_sizes: list[int], place: dict[str, Any], total: int, repeats: int,
               progress: Callable | None, notes: list[str] | None) -> list[dict[str, Any]]:
    """CPU<->FILE and engine<->FILE rows, in a fresh directory under `place["parent"]`."""
    from kvtier.bench.file_hops import measure_cpu_file

    rows: list[dict[str, Any]] = []
    work = tempfile.mkdtemp(prefix="kvtier-bench-", dir=place["parent"])
    try:
        update = progress("CPU<->FILE") if progress else None
        for i, size in enumerate(block_sizes):
            figures = measure_cpu_file(work, size, max(total, 8 * size), repeats=repeats)
            rows += file_rows(figures)
            if update:
                update(i + 1, len(block_sizes))
        paths, why_not = engine_file_paths(device)
        if why_not and notes is not None:
            notes.append(why_not)
        if paths:
            from kvtier.bench.engine_file_hops import measure_engine_file

            update = progress(f"engine({device})<->FILE") if progress else None
            for i, size in enumerate(block_sizes):
                nbytes = size * hop_blocks(size, max(total, 8 * size), least=2)
                rows += measure_engine_file(work, device, size, nbytes, repeats, paths)
                if update:
                    update(i + 1, len(block_sizes))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def capped_note(block_sizes: list[int], total: int) -> list[str]:
    """A line naming the block sizes whose hops move `MAX_HOP_BLOCKS` blocks (`hop_blocks`), fewer bytes than
    `total` (none when every size moves its full share)."""
    from kvtier.config import format_size

    small = [s for s in block_sizes if hop_blocks(s, total) < total // s]
    if not small:
        return []
    return [f"block sizes {', '.join(format_size(s) for s in small)}: each hop moves at most {hop_blocks(1, total):,} "
            f"blocks to keep memory bounded, so fewer bytes than at larger sizes; their figures are dominated by "
            f"per-block costs"]


def valkey_tiers(config: Any) -> list[Any]:
    """The config's valkey tiers, in order."""
    return [tier for tier in config.tiers if tier.backend == "valkey"]


def engine_hop_bytes(device: str, quick: bool) -> int:
    """Bytes each engine<->CPU copy moves: the default (`QUICK_ENGINE_BYTES`, `FULL_BYTES`) or, for
    host copies (the engine's KV cache in CPU tensors), `CACHE_MARGIN` more than the last-level
    cache where that is more, so that the baseline cannot run from cache; at most 1/`MEMORY_SHARE`
    of the available memory (past it the row is flagged `cache-resident` instead)."""
    size = QUICK_ENGINE_BYTES if quick else FULL_BYTES
    cache = last_level_cache_bytes() if device == "cpu" else None
    if not cache or cache < size:
        return size
    try:
        room = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MEMORY_SHARE
    except (ValueError, OSError):
        room = size
    return max(size, min(cache + CACHE_MARGIN, room))


def remote_rows(config: Any, block_sizes: list[int], total: int, progress: Callable | None) -> list[dict[str, Any]]:
    """CPU<->REMOTE rows for each `valkey` tier of the config (on its server, under a bench prefix);
    `RemoteUnavailable` names a tier whose server fails (its `rows`: this tier's rows before)."""
    from kvtier.bench.remote_hops import RemoteUnavailable, measure_tier, remote_rows

    rows: list[dict[str, Any]] = []
    for tier in valkey_tiers(config):
        options = dict(tier.options)
        update = progress(f"CPU<->REMOTE ({tier.name})") if progress else None
        for i, size in enumerate(block_sizes):
            try:
                figures = measure_tier(tier.name, options, size, max(total, 8 * size))
            except RemoteUnavailable as exc:
                exc.rows = rows
                raise
            if figures is not None:
                rows += remote_rows(figures, options["url"])
            if update:
                update(i + 1, len(block_sizes))
    return rows


def hop_label(row: dict[str, Any]) -> str:
    """A hop's display name: 'GPU' becomes 'engine' when the engine's KV cache is in CPU memory;
    rows into scattered CPU slots say so, engine<->FILE rows name their handler path."""
    name = row["hop"].replace("GPU", "engine") if row.get("device") == "cpu" else row["hop"]
    if row.get("slots") == "scattered":
        return f"{name} scattered"
    return f"{name} {row['path']}" if row.get("path") else name


def _raw_seconds(figures: dict[str, Any], kind: str) -> list[float]:
    """The raw baseline's samples of `kind` (`w` write, `r` read, `f` first fill): the thread count
    with the better median (as `measure_cpu_file` chose it)."""
    from statistics import median

    one, many = figures["seconds"][kind + "1"], figures["seconds"][kind + "t"]
    return one if median(one) <= median(many) else many


def file_rows(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The two hop rows (store, load) of one `measure_cpu_file` result, with its raw baselines."""
    common = {"block_bytes": figures["block_bytes"], "total_bytes": figures["total_bytes"], "io": figures["io"],
              "o_direct": figures["o_direct"], "verified": True}
    nbytes, seconds = figures["total_bytes"], figures["seconds"]
    store = {"hop": "CPU->FILE", **common, "baseline": "raw O_DIRECT write",
             "first_fill_gbps": figures["store_first_fill_gbps"], "raw_first_fill_gbps": figures["raw_first_fill_gbps"]}
    load = {"hop": "FILE->CPU", **common, "baseline": "raw O_DIRECT read"}
    return [annotate(store, seconds["store"], _raw_seconds(figures, "w"), nbytes),
            annotate(load, seconds["load"], _raw_seconds(figures, "r"), nbytes)]


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
