"""Index memory per resident block, measured as RSS growth (issue 19: <= 100 bytes including the key).

    python -m benchmarks.memory [--blocks 1000000,8000000] [--policies lru,lru-py,prefix-freq,prefix-freq-py,vllm-lru]
                                  [--churn X] [--json FILE]

Each (policy, N) runs in a fresh child process: resident set size (/proc/self/statm) before, then
N resident blocks inserted the way the manager stores them (evictable accounting on:
`insert_many` of `BlockStatus.many` blocks being written, `evictable(keys, False)`, `ref_cnt = 0`
through `get`, `evictable(keys, True)`), in chunks of 64Ki keys of 32-byte block hash + 4-byte
group (vLLM's sha256 keys), then
`gc.collect()` and RSS after. The chunks' key lists are dropped after each chunk: a dict-based
policy keeps every key object (that is its real cost), the compact index copies the bytes and
keeps none. `lru` and `prefix-freq` are the registered names (the compiled indexes when they are
built), `lru-py` and `prefix-freq-py` the pure-Python `PureLRUCachePolicy` and `PurePrefixFreqCachePolicy`
(their fallbacks). `vllm-lru` is vLLM's `CPUOffloadingManager` with its
LRU policy, driven through `prepare_store`/`complete_store` with one request context per chunk
(dropped after it).

Figures are bytes of RSS growth per block (so they include allocator overhead and the
fragmentation the insert pattern causes) and, for the compiled indexes, the bytes their arrays allocate.
`--churn X` also stores X times N more blocks in the same way, each chunk evicting as many, and
reports the RSS growth per resident block after that: the history a policy keeps of evicted
blocks (prefix-freq's ghost list, counted in `ghosts`) at its steady state.
This is a benchmark, not a test: it prints rows and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import child_env

POLICIES = ("lru", "lru-py", "prefix-freq", "prefix-freq-py", "vllm-lru")
PURE = {"lru-py": "kvtier.policies.lru_pure:PureLRUCachePolicy",  # bench names that are not registered:
        "prefix-freq-py": "kvtier.policies.prefix_pure:PurePrefixFreqCachePolicy"}  # the pure-Python policies
CHUNK = 1 << 16
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def hash_keys(start: int, stop: int) -> list[Any]:
    """Keys `start..stop-1`: a 32-byte hash (distinct, hash-like bytes) + a 4-byte group 0."""
    return [((i * 0x9E3779B97F4A7C15) % (1 << 256)).to_bytes(32, "big") + b"\0\0\0\0" for i in range(start, stop)]


def _fill_kvtier(name: str, n: int, start: int = 0, stop: int | None = None, policy: Any = None) -> Any:
    """Insert blocks `start..stop-1` (default `0..n-1`) into `policy` (default a new tracking
    policy `name` of capacity `n`), chunk by chunk, evicting first what the chunk needs."""
    from kvtier.core.types import BlockStatus
    from kvtier.policies.base import with_key_index
    from kvtier.transfer import registry

    if policy is None:
        policy = with_key_index(registry.resolve(registry.POLICIES, PURE.get(name, name))(n))
        policy.evictable((), False)  # the block table's first notice: accounting on
    step = min(CHUNK, n)  # (a chunk evicts at most the whole tier)
    for first in range(start, n if stop is None else stop, step):
        keys = hash_keys(first, min(n if stop is None else stop, first + step))
        over = len(policy) + len(keys) - n
        if over > 0:
            assert policy.evict(over, set()) is not None, f"{name} refused to evict {over} blocks"
        policy.insert_many(keys, BlockStatus.many(range(first, first + len(keys))))
        policy.evictable(keys, False)  # being written
        for block in map(policy.get, keys):
            block.ref_cnt = 0  # just inserted
        policy.evictable(keys, True)
        del keys
    return policy


def _fill_vllm(n: int, start: int = 0, stop: int | None = None, manager: Any = None) -> Any:
    """The same through vLLM's manager (`prepare_store` evicts what a chunk needs)."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    if manager is None:
        manager = CPUOffloadingManager(num_chunks=n, cache_policy="lru")
    step = min(CHUNK, n)
    for first in range(start, n if stop is None else stop, step):
        keys = hash_keys(first, min(n if stop is None else stop, first + step))
        ctx = ReqContext(req_id=f"fill-{first}")
        out = manager.prepare_store(keys, ctx)
        assert out is not None and len(out.keys_to_store) == len(keys), "vLLM refused a store"
        manager.complete_store(keys, ctx)
        del keys, ctx, out
    return manager


def measure(name: str, n: int, churn: float = 0.0) -> dict[str, Any]:
    """In a fresh process: RSS growth of `n` resident blocks in policy `name`; with `churn`,
    also after `churn * n` more blocks were stored, each chunk evicting as many (the history a
    policy keeps of evicted blocks, such as prefix-freq's ghosts, at its steady state)."""
    if name == "vllm-lru":
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401 - imported before the first reading
    else:
        import kvtier.policies.lru_compiled  # noqa: F401
        from kvtier.core.types import BlockStatus  # noqa: F401
        from kvtier.transfer import registry

        registry.resolve(registry.POLICIES, PURE.get(name, name))
    hash_keys(0, 8)
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    held = _fill_vllm(n) if name == "vllm-lru" else _fill_kvtier(name, n)
    seconds = time.perf_counter() - t0
    gc.collect()
    after = rss_bytes()
    policy = held._policy if name == "vllm-lru" else held
    resident = len(policy.chunks) if name == "vllm-lru" else len(policy)
    assert resident == n, f"{name}: {resident} blocks resident after inserting {n}"
    row = {"policy": name, "blocks": n, "rss_before": before, "rss_after": after,
           "bytes_per_block": round((after - before) / n, 1), "fill_seconds": round(seconds, 2)}
    if hasattr(policy, "memory_bytes"):
        row["allocated_bytes_per_block"] = round(policy.memory_bytes() / n, 1)
    if churn:
        extra = int(churn * n)
        if name == "vllm-lru":
            _fill_vllm(n, n, n + extra, held)
        else:
            _fill_kvtier(name, n, n, n + extra, held)
        gc.collect()
        row["churned_blocks"] = extra
        row["bytes_per_block_after_churn"] = round((rss_bytes() - before) / n, 1)
        ghosts = getattr(policy, "ghosts", None)
        row["ghosts"] = 0 if ghosts is None else len(ghosts)
    return row


def run_child(name: str, n: int, churn: float = 0.0) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--child", f"{name}:{n}:{churn}"],
                         capture_output=True, text=True, env=child_env())
    if out.returncode != 0:
        raise RuntimeError(f"{name} at {n} blocks failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="1000000,8000000", help="resident block counts (default 1000000,8000000)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"default {','.join(POLICIES)}")
    parser.add_argument("--churn", type=float, default=0.0, metavar="X",
                        help="also measure after X times the blocks more were stored, evicting as many (default 0)")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.churn < 0:
        parser.error(f"--churn must be >= 0, got {args.churn}")
    if args.child:
        rest, _, churn = args.child.rpartition(":")
        name, _, n = rest.rpartition(":")
        print(json.dumps(measure(name, int(n), float(churn))))
        return 0
    from kvtier.bench.replay import parse_counts

    counts = parse_counts(args.blocks)
    names = [p for p in args.policies.split(",") if p]
    after = f"{'after churn':>13}{'ghosts':>10}" if args.churn else ""
    print(f"{'policy':<16}{'blocks':>10}{'B/block (RSS)':>15}{'allocated':>11}{'fill s':>8}{after}")
    rows = []
    for n in counts:
        for name in names:
            row = run_child(name, n, args.churn)
            rows.append(row)
            allocated = row.get("allocated_bytes_per_block")
            churned = f"{row['bytes_per_block_after_churn']:>13.1f}{row['ghosts']:>10,}" if args.churn else ""
            print(f"{name:<16}{n:>10}{row['bytes_per_block']:>15.1f}"
                  f"{'' if allocated is None else f'{allocated:.1f}':>11}{row['fill_seconds']:>8.1f}{churned}",
                  flush=True)
    if args.json:
        from kvtier.bench.provenance import provenance  # (not at the top: a child measures its own imports)

        doc = {"schema": "kvtier.bench.memory/1", **provenance(),
               "key_bytes": 36, "churn": args.churn, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
