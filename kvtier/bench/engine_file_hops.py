"""Engine KV cache <-> file tier (no CPU-tier slot between) through the staged and the direct
handler, next to a raw baseline measured in the same run on the same bytes.

`measure_engine_file(root_dir, device, block_bytes, total_bytes, repeats, paths)`: the engine's KV
cache is one tensor of `total_bytes / block_bytes` blocks on `device`; for each path in `paths`
(`staged`: `GPUFileHandler`, pages gathered into a host staging buffer then written; `direct`:
`DirectGPUFileHandler`, kvikio between device memory and the slab), a fresh file tier is filled
from shuffled engine blocks in jobs of `JOB_BLOCKS` (all submitted at once, timed until the tier's
`sync()` made them durable) and read back, `repeats` rounds alternating with the baseline: one
contiguous copy between the engine and a page-aligned host buffer plus raw `O_DIRECT` I/O of that
buffer (8 MiB I/Os on as many threads as the tier, fdatasync after writing). Afterwards the
engine is cleared, loaded through the handler and compared with its original bytes:
`TransferCorrupted` if anything differs. Rows: `hop` `GPU->FILE` / `FILE->GPU`, `path`, plus
`kvtier.bench.spread.annotate`'s keys.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.bench.file_hops import BENCH_MODEL, BENCH_TOKENS, _check_jobs, _key
from kvtier.bench.hops import TransferCorrupted, interleaved
from kvtier.bench.hops_runner import run_jobs
from kvtier.bench.spread import annotate
from kvtier.tiers.file.backend import RUN_BYTES, FileBackend

JOB_BLOCKS = 16
THREADS = 4
PATHS = ("staged", "direct")


def _raw_io(path: Path, host, threads: int) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(write, read, close) of the whole page-aligned `host` buffer with O_DIRECT, in RUN_BYTES I/Os
    spread over `threads` threads; write ends with fdatasync."""
    view = memoryview(host.numpy().reshape(-1))
    chunks = [(view[o:o + RUN_BYTES], o) for o in range(0, len(view), RUN_BYTES)]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, len(view))
    except BaseException:
        os.close(fd)
        raise
    pool = ThreadPoolExecutor(threads)

    def run(op) -> None:
        def part(t: int) -> None:
            for chunk, offset in chunks[t::threads]:
                op(fd, [chunk], offset)
        list(pool.map(part, range(threads)))

    def write() -> None:
        run(os.pwritev)
        os.fdatasync(fd)

    def close() -> None:
        pool.shutdown()
        os.close(fd)
    return write, lambda: run(os.preadv), close


def measure_engine_file(root_dir: str, device: str, block_bytes: int, total_bytes: int, repeats: int = 3,
                        paths: Sequence[str] = ("staged",)) -> list[dict[str, Any]]:
    """GPU->FILE and FILE->GPU rows for each handler path (see the module docstring)."""
    import torch

    from kvtier.core.types import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    from kvtier.transfer.handlers.gpu_file import aligned_rows
    from kvtier.transfer.handlers.kv_layout import KVLayout, blocks_per_chunk_of

    n = max(2, total_bytes // block_bytes)
    engine = torch.randint(-128, 128, (n, block_bytes), dtype=torch.int8, device=device)
    reference = engine.clone()
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(engine, block_bytes)], [[CanonicalKVCacheRef(0, block_bytes)]])
    layout = KVLayout(kv, blocks_per_chunk_of(kv))
    engine_ids = torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist()
    host = aligned_rows(n, block_bytes, pin=device == "cuda")
    work = Path(tempfile.mkdtemp(prefix="kvtier-engine-file-", dir=root_dir))  # 0700, a name nobody planted
    try:
        raw_write, raw_read, raw_close = _raw_io(work / "raw", host, THREADS)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    engine_bytes, host_blocks = engine.view(torch.uint8), host[:, :block_bytes]
    nb = device == "cuda"

    def base_store() -> None:
        host_blocks.copy_(engine_bytes, non_blocking=nb)
        if nb:
            torch.cuda.synchronize()
        raw_write()

    def base_load() -> None:
        raw_read()
        engine_bytes.copy_(host_blocks, non_blocking=nb)

    rows: list[dict[str, Any]] = []
    try:
        for path in paths:
            rows += _path_rows(path, work, layout, engine, reference, engine_ids, device, repeats,
                               (base_store, base_load))
    finally:
        raw_close()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _path_rows(path: str, work: Path, layout, engine, reference, engine_ids: list[int], device: str, repeats: int,
               baselines: tuple[Callable[[], None], Callable[[], None]]) -> list[dict[str, Any]]:
    """The store and load rows of one handler path, on a fresh file tier."""
    import torch

    from kvtier.core.specs import GPULoadStoreSpec
    from kvtier.tiers.file.spec import FileLoadStoreSpec
    from kvtier.transfer.handlers.gpu_file import GPUFileHandler
    from kvtier.transfer.handlers.gpu_file_direct import DirectGPUFileHandler

    n, block_bytes = len(engine_ids), layout.block_bytes
    cls = DirectGPUFileHandler if path == "direct" else GPUFileHandler
    disk = FileBackend("disk", n, block_bytes, BENCH_TOKENS, root_dir=str(work / path), io="posix",
                       num_threads=THREADS, fingerprint=BENCH_MODEL)
    handlers: list[Any] = []
    try:
        handlers += [cls({"disk": disk}, layout, True, num_threads=THREADS)]
        handlers += [cls({"disk": disk}, layout, False, num_threads=THREADS)]
        store, load = handlers
        batches = [range(s, min(n, s + JOB_BLOCKS)) for s in range(0, n, JOB_BLOCKS)]
        pairs = [(GPULoadStoreSpec([engine_ids[i] for i in b]),
                  FileLoadStoreSpec(list(b), [_key(i) for i in b], tier="disk")) for b in batches]

        def ours_store() -> None:
            _check_jobs(f"engine->FILE ({path})", run_jobs(store, pairs, then=disk.sync)[1])

        def ours_load() -> None:
            _check_jobs(f"FILE->engine ({path})", run_jobs(load, [(f, g) for g, f in pairs])[1])

        nbytes, rows = n * block_bytes, []
        common = {"path": path, "device": device, "block_bytes": block_bytes, "blocks": n, "total_bytes": nbytes}
        for hop, ours, base, what in (("GPU->FILE", ours_store, baselines[0], "raw O_DIRECT write+copy"),
                                      ("FILE->GPU", ours_load, baselines[1], "raw O_DIRECT read+copy")):
            ours_s, base_s = interleaved((ours, base), device, repeats)
            rows.append(annotate({"hop": hop, **common, "baseline": what}, ours_s, base_s, nbytes))
        engine.copy_(reference)
        ours_store()
        engine.zero_()
        ours_load()
        if not torch.equal(engine, reference):
            raise TransferCorrupted(f"engine<->FILE ({path}) with {block_bytes}-byte blocks moved wrong bytes: a "
                                    f"defect of the handler, not a figure (please report it)")
        for row in rows:
            row["verified"] = True
        return rows
    finally:
        for handler in handlers:
            handler.shutdown()
        disk.close()
