"""Engines of one model sharing the host owner's hierarchy (issue 39), standalone `KVTier`s on CPU.

    python -m benchmarks.host_share [--blocks 256] [--engines 1,2,4] [--page-kib 32] [--reps 5] [--valkey]
                                    [--json FILE]

For each engine count N: one `kvtier serve` owner, then N engine processes, each a standalone
`KVTier` with `shared: host` around its own KV tensors (2 tensors of `--page-kib` KiB pages, so a
block is twice that). Engine 0 stores `--blocks` blocks; every engine then loads them into its
own (wiped) tensors, `--reps` times, and checks every byte against what engine 0 stored. Beside
it, in the same process, the same blocks through a private CPU tier of its own (the engine's own
CPU-tier hit: store, wipe, load). Figures per engine: median seconds per load of all the blocks,
shared and private, and their ratio; memory while all N engines are up: the bytes of /dev/shm
held by kvtier regions (the owner's one region, and the engines' private ones) and each engine's
proportional set size (PSS: a shared page counted once across the processes that map it).
With `--valkey`, today's way beside it: each engine's first load of the blocks through a valkey
tier on loopback under a private CPU tier (engine 0 stores and publishes them).

This is a benchmark, not a test: it prints rows and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "bench-host-share"


def _kv(blocks: int, page: int, seed: int):
    import torch

    from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 128, (blocks, page), dtype=torch.int8, generator=g) for _ in range(2)]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                             [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])


def _config(root: str, blocks: int, shared: bool, valkey_url: str | None = None):
    from kvtier import load_config_text

    head = f"shared: {{scope: host, socket: {root}/run/host.sock, timeout_ms: 1000}}\n" if shared else ""
    tiers = f"  - {{name: cpu, backend: cpu, capacity: {blocks * 2} blocks, pin: false}}\n"
    if valkey_url:
        tiers += (f"  - {{name: shared, backend: valkey, capacity: {blocks * 2} blocks, url: '{valkey_url}', "
                  f"key_prefix: kvtbench, timeout_ms: 2000}}\n")
    return load_config_text(f"{head}tiers:\n{tiers}")


def _pss_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))


def _timed_loads(tier: Any, kv: Any, keys: list, reps: int) -> tuple[float, int]:
    ids = list(range(len(keys)))
    times, loaded = [], 0
    for _ in range(reps):
        for t in kv.tensors:
            t.tensor.zero_()
        start = time.perf_counter()
        loaded = tier.load(keys, ids)
        times.append(time.perf_counter() - start)
    return statistics.median(times), loaded


def engine(root: str, index: int, blocks: int, page: int, reps: int, valkey_url: str | None) -> None:
    """One engine process: store (engine 0), load shared and private, report, wait for stdin to close."""
    import torch

    from kvtier import make_offload_key
    from kvtier.standalone import KVTier

    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(blocks)]
    reference = _kv(blocks, page, seed=1)
    kv = _kv(blocks, page, seed=1) if index == 0 else _kv(blocks, page, seed=100 + index)
    shared = KVTier.open(_config(root, blocks, True), kv, model=MODEL)
    if index == 0:
        assert shared.store(keys, list(range(blocks)))
    else:
        while shared.lookup(keys) < blocks:  # (engine 0 stores first)
            time.sleep(0.05)
    shared_s, loaded = _timed_loads(shared, kv, keys, reps)
    identical = all(torch.equal(a.tensor, b.tensor) for a, b in zip(kv.tensors, reference.tensors))
    private_kv = _kv(blocks, page, seed=1)
    private = KVTier.open(_config(root, blocks, False), private_kv, model=MODEL)
    assert private.store(keys, list(range(blocks)))
    private_s, _ = _timed_loads(private, private_kv, keys, reps)
    row = {"engine": index, "loaded": loaded, "identical": identical, "shared_load_s": shared_s,
           "private_load_s": private_s, "pss_kib": _pss_kib()}
    if valkey_url:
        row.update(_valkey_first_load(root, index, blocks, page, keys, reference, valkey_url))
    print(json.dumps(row), flush=True)
    sys.stdin.read()  # held up until the parent has measured /dev/shm with every engine alive
    shared.close()
    private.close()


def _valkey_first_load(root: str, index: int, blocks: int, page: int, keys: list, reference: Any,
                       url: str) -> dict[str, Any]:
    """Today's way to share between engines: a private CPU tier over a valkey tier on loopback.
    Engine 0 stores (and publishes); another engine's first load of the blocks comes through the
    server (probes, then promotion into its CPU tier). Seconds of that first load, bytes checked."""
    import torch

    from kvtier.standalone import KVTier

    kv = _kv(blocks, page, seed=1 if index == 0 else 200 + index)
    with KVTier.open(_config(root, blocks, False, url), kv, model=MODEL) as tier:
        if index == 0:
            assert tier.store(keys, list(range(blocks)))
            assert tier.flush(timeout=60) == 0
            return {}
        for t in kv.tensors:
            t.tensor.zero_()
        start = time.perf_counter()
        loaded = tier.load(keys, list(range(blocks)))
        seconds = time.perf_counter() - start
        same = all(torch.equal(a.tensor, b.tensor) for a, b in zip(kv.tensors, reference.tensors))
        return {"valkey_first_load_s": seconds, "valkey_loaded": loaded, "valkey_identical": same}


def _valkey(root: str) -> tuple[subprocess.Popen, str]:
    """A valkey-server on a free loopback port (persistence off), and its url."""
    import shutil
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--valkey needs valkey-server (or redis-server) on PATH: scripts/setup.sh installs it")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", "2gb", "--dir", root], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"redis://127.0.0.1:{port}"
        time.sleep(0.02)
    proc.kill()
    raise SystemExit("valkey-server did not start")


def _shm_bytes(prefix: str) -> int:
    return sum(p.stat().st_size for p in Path("/dev/shm").glob(prefix + "*"))


def run(engines: int, blocks: int, page: int, reps: int, valkey: bool) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="kvtier-host-bench-")
    server, url = _valkey(root) if valkey else (None, None)
    owner = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "serve", "--socket", f"{root}/run/host.sock"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert owner.stdout is not None and "listening" in owner.stdout.readline()
    procs, rows = [], []
    try:
        for i in range(engines):
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.host_share", "--engine", str(i),
                                           "--root", root, "--blocks", str(blocks), "--page-kib", str(page // 1024),
                                           "--reps", str(reps), *(["--valkey-url", url] if url else [])],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            if i == 0:  # (stored before the others look)
                rows.append(json.loads(procs[0].stdout.readline()))  # type: ignore[union-attr]
        rows += [json.loads(p.stdout.readline()) for p in procs[1:]]  # type: ignore[union-attr]
        owner_region = _shm_bytes("kvtier-host-")
        private_regions = sum(_shm_bytes(f"kvtier-{p.pid}-") for p in procs)  # (generated names start so)
    finally:
        for p in procs:
            p.communicate("")
        owner.terminate()
        owner.wait(timeout=60)
        if server is not None:
            server.kill()
    block_bytes = 2 * page
    for row in rows:
        row["ratio"] = row["shared_load_s"] / row["private_load_s"]
        row["shared_gbps"] = blocks * block_bytes / row["shared_load_s"] / 1e9
    return {"engines": engines, "blocks": blocks, "block_bytes": block_bytes, "owner_shm_bytes": owner_region,
            "private_shm_bytes": private_regions, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--engines", default="1,2,4")
    parser.add_argument("--page-kib", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--valkey", action="store_true",
                        help="also load through a valkey tier on loopback (today's way between engines)")
    parser.add_argument("--engine", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--valkey-url", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    page = args.page_kib * 1024
    if args.engine is not None:
        engine(args.root, args.engine, args.blocks, page, args.reps, args.valkey_url)
        return 0
    results = []
    print(f"{'engines':>7} {'engine':>6} {'shared ms':>9} {'private ms':>10} {'ratio':>6} {'GB/s':>6} "
          f"{'same bytes':>10} {'PSS MiB':>8} {'owner shm MiB':>13} {'private shm MiB':>15}")
    for n in (int(x) for x in args.engines.split(",")):
        result = run(n, args.blocks, page, args.reps, args.valkey)
        results.append(result)
        for row in result["rows"]:
            print(f"{n:>7} {row['engine']:>6} {row['shared_load_s'] * 1e3:>9.2f} {row['private_load_s'] * 1e3:>10.2f} "
                  f"{row['ratio']:>6.2f} {row['shared_gbps']:>6.2f} {str(row['identical']):>10} "
                  f"{row['pss_kib'] / 1024:>8.1f} {result['owner_shm_bytes'] / 2**20:>13.1f} "
                  f"{result['private_shm_bytes'] / 2**20:>15.1f}"
                  + (f"  valkey first load {row['valkey_first_load_s'] * 1e3:.2f} ms ({row['valkey_loaded']} blocks, "
                     f"same bytes {row['valkey_identical']})" if "valkey_first_load_s" in row else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(result_doc(results), indent=2))
    return 0


def result_doc(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON `--json` writes: `kvtier.bench.provenance.provenance()` (when, which commit, which
    machine: docs/bench.md) and the results."""
    from kvtier.bench.provenance import provenance

    return {**provenance(), "benchmark": "host_share", "results": results}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
