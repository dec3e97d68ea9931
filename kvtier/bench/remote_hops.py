"""CPU <-> REMOTE hop bandwidth through the tier's handlers vs the same client's raw SET/GET.

`measure_cpu_remote(tier_options, block_bytes, total_bytes)` (used by `kvtier bench hops` when the
config has a `valkey` tier): `total_bytes` of random blocks in a memory tier are published to a
`ValkeyBackend` built from the tier's options, under `{key_prefix}:bench-hops` (inside the tier's
namespace, so the tenant's ACL user may write there; the bench's own identity, so no engine ever
serves these values) through `CPUToRemoteHandler`, in as many jobs as the tier has threads, all
submitted at once (as the manager publishes), timed until the last job completed; then loaded back
through `RemoteToCPUHandler` (verified, byte-compared). The baseline, in the same run, rounds
interleaved: the same client library with the same connection settings (`kvtier.tiers.remote.bench`),
one SET per block of the same bytes (as `bytes` objects: a memoryview is packed much slower by
redis-py with hiredis) and one GET per block copied into a preallocated buffer, on
one thread and on as many threads as the tier (the baseline is the better of the two; redis-py
packs in Python, under the GIL). Medians of `repeats` rounds; GB/s = 1e9 bytes per second;
`paired_ratio` is the median over rounds of (that round's best raw time / the tier's time).
The server holds about 2 x `total_bytes` (tier values + raw keys) during the run; at the end every key
under `{key_prefix}:bench-hops:` is removed (SCAN + UNLINK in batches, also what an interrupted run
left), best effort: `removed_keys` counts them, `cleanup_error` says what failed (and a WARNING).
A cluster URL has no single-server baseline: no rows. At most `MAX_HOP_BLOCKS` blocks are moved
(`kvtier.bench.hops`), whatever the block size.

`measure_tier(name, tier_options, ...)` is what `kvtier bench hops` calls: a server that cannot be
used, found by `check_reachable` (one PING, as `kvtier doctor` asks, within the tier's `timeout_ms`)
before or after a failed measurement, raises `RemoteUnavailable` naming the tier and the server.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.bench.hops import TransferCorrupted, hop_blocks
from kvtier.bench.hops_runner import run_jobs
from kvtier.core.errors import KVTierError
from kvtier.core.keys import make_offload_key

BENCH_SUFFIX = "bench-hops"
CLEANUP_BATCH = 500

log = logging.getLogger(__name__)


class RemoteUnavailable(KVTierError):
    """A valkey tier's server cannot be used to measure its hops (exit status 2); `rows` holds the
    rows measured before it failed (the caller fills them in)."""

    def __init__(self, message: str, rows: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.rows: list[dict[str, Any]] = rows or []


class RemoteJobsFailed(RuntimeError):
    """Jobs of the tier's own handlers failed (the server went away, refused, timed out)."""


def check_reachable(name: str, tier_options: dict[str, Any]) -> None:
    """Raise `RemoteUnavailable` naming tier `name` and its server unless the server answers one
    PING (and EXISTS) with the tier's settings, as `kvtier doctor --config` asks it."""
    from kvtier.tiers.remote.backend import ValkeyBackend

    _notes, problems = ValkeyBackend.check_environment(dict(tier_options))
    if problems:
        found = "; ".join(f"{field}: {message}" for field, message in problems)
        raise RemoteUnavailable(f"valkey tier {name!r} cannot be measured: {found} (`kvtier doctor --config` "
                                f"checks every valkey tier of a config)")


def measure_tier(name: str, tier_options: dict[str, Any], block_bytes: int, total_bytes: int,
                 repeats: int = 5) -> dict[str, Any] | None:
    """`measure_cpu_remote` of valkey tier `name`; a failure of the server (the client's errors, the
    handlers' failed jobs) is `RemoteUnavailable` naming the tier and the server."""
    try:
        return measure_cpu_remote(tier_options, block_bytes, total_bytes, repeats)
    except TransferCorrupted:
        check_reachable(name, tier_options)  # a server gone mid-run is no verdict on the bytes
        raise
    except Exception as exc:  # noqa: BLE001 - the server's state decides below what it was
        if not _server_failure(exc):
            raise
        check_reachable(name, tier_options)  # raises when the server is gone: the clearer message
        from kvtier.tiers.remote.options import ClientOptions

        servers = ", ".join(e.name for e in ClientOptions(tier_options["url"]).parsed.endpoints)
        raise RemoteUnavailable(f"valkey tier {name!r} (server {servers}): measuring {block_bytes}-byte blocks "
                                f"failed ({type(exc).__name__}: {str(exc)[:300]})") from exc


def _server_failure(exc: BaseException) -> bool:
    """Whether `exc` is the client's or the handlers' report of a server failure."""
    if isinstance(exc, (RemoteJobsFailed, ConnectionError, TimeoutError)):
        return True
    try:
        from redis.exceptions import RedisError
    except ImportError:
        return False
    return isinstance(exc, RedisError)


def remove_bench_keys(raw, prefix: str) -> tuple[int, str]:
    """UNLINK every key under `prefix:` (SCAN + UNLINK in batches); (keys removed, error or "")."""
    removed, batch = 0, []
    try:
        for key in raw.scan_iter(match=f"{prefix}:*", count=CLEANUP_BATCH):
            batch.append(key)
            if len(batch) >= CLEANUP_BATCH:
                removed += raw.unlink(*batch)
                batch = []
        if batch:
            removed += raw.unlink(*batch)
    except Exception as exc:  # noqa: BLE001 - best effort: report, never hide the figures
        error = f"{type(exc).__name__}: {exc}"
        log.warning("bench hops: could not remove the bench's keys under %s:* (%s); %d removed", prefix, error,
                    removed)
        return removed, error
    return removed, ""


def _timed_jobs(handler, jobs: list[tuple]) -> float:
    """`run_jobs` in seconds; raises if a job failed."""
    seconds, results = run_jobs(handler, jobs)
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RemoteJobsFailed(f"{len(failed)} of {len(jobs)} jobs failed: {failed[0]}")
    return seconds


class _RawRounds:
    """The baseline's rounds: the raw client's SET of each block's bytes, and GET of each into a
    preallocated buffer, on one thread or one per part of `parts` (on `pool`); seconds per round."""

    def __init__(self, raw, raw_keys: list[bytes], payloads: list[bytes], parts: list[list[int]], pool,
                 block_bytes: int):
        self.raw, self.raw_keys, self.payloads, self.parts, self.pool = raw, raw_keys, payloads, parts, pool
        self.outs = [memoryview(bytearray(block_bytes)) for _ in parts]

    def _set(self, index: int, part: list[int]) -> None:
        for i in part:
            self.raw.set(self.raw_keys[i], self.payloads[i])

    def _get(self, index: int, part: list[int]) -> None:
        for i in part:
            value = self.raw.get(self.raw_keys[i])
            assert isinstance(value, bytes)
            self.outs[index][:] = value

    def run(self, op: str, threaded: bool) -> float:
        fn = self._set if op == "set" else self._get
        start = time.perf_counter()
        if not threaded:
            fn(0, list(range(len(self.payloads))))
            return time.perf_counter() - start
        futures = [self.pool.submit(fn, j, p) for j, p in enumerate(self.parts)]
        for future in futures:
            future.result()
        return time.perf_counter() - start


def _figures(times: dict[str, list[float]], n: int, block_bytes: int, threads: int, repeats: int) -> dict[str, Any]:
    """GB/s of each median round time, the baselines at their best, and the paired ratios."""
    gbps = {name: n * block_bytes / statistics.median(t) / 1e9 for name, t in times.items()}
    # The baseline is the raw client at its best: on one thread or on as many as the tier.
    gbps["raw_set"] = max(gbps["raw_set_1"], gbps["raw_set_n"])
    gbps["raw_get"] = max(gbps["raw_get_1"], gbps["raw_get_n"])
    # Each round's tier time against that round's best raw time: the machine's drift between
    # rounds (other work on shared cores) cancels out of these.
    paired = {hop: round(statistics.median(min(t1, tn) / t for t1, tn, t in
                                           zip(times[f"raw_{op}_1"], times[f"raw_{op}_n"], times[hop])), 3)
              for hop, op in (("store", "set"), ("load", "get"))}
    return {"block_bytes": block_bytes, "total_bytes": n * block_bytes, "threads": threads,
            "repeats": repeats, **{f"{name}_gbps": round(v, 3) for name, v in gbps.items()},
            "store_vs_raw_paired": paired["store"], "load_vs_raw_paired": paired["load"]}


def _jobs(threads: int, keys: list, memory, remote) -> tuple[list[list[int]], list[tuple], list[tuple]]:
    """The n = len(keys) blocks in `threads` parts of consecutive indices, then (the parts, store jobs:
    memory slots -> the remote keys, load jobs: those keys -> memory slots n + i), one per part."""
    from kvtier.core.specs import CPULoadStoreSpec
    from kvtier.tiers.remote.spec import RemoteLoadStoreSpec

    n = len(keys)
    per_job = -(-n // threads)
    parts = [list(range(i, min(n, i + per_job))) for i in range(0, n, per_job)]

    store_jobs = [(CPULoadStoreSpec(p, tier=memory.name), RemoteLoadStoreSpec(p, [keys[i] for i in p],
                                                                              tier=remote.name)) for p in parts]
    load_jobs = [(RemoteLoadStoreSpec(p, [keys[i] for i in p], tier=remote.name),
                  CPULoadStoreSpec([n + i for i in p], tier=memory.name)) for p in parts]
    return parts, store_jobs, load_jobs


def _verify(memory, n: int, block_bytes: int) -> None:
    """Blocks n..2n-1 of `memory` (loaded back) equal blocks 0..n-1 (stored), else TransferCorrupted."""
    if any(bytes(memory.view(n + i)) != bytes(memory.view(i)) for i in range(n)):
        raise TransferCorrupted(f"REMOTE->CPU with {block_bytes}-byte blocks read a block back wrong: a defect "
                                f"of the remote tier's handlers, not a figure (please report it)")


def measure_cpu_remote(tier_options: dict[str, Any], block_bytes: int, total_bytes: int,
                       repeats: int = 5) -> dict[str, Any] | None:
    """Figures of one block size (module docstring); None for a cluster URL."""
    from kvtier.tiers.memory import MemoryBackend
    from kvtier.tiers.remote.backend import ValkeyBackend
    from kvtier.tiers.remote.bench import _raw_client
    from kvtier.tiers.remote.handler import CPUToRemoteHandler, RemoteToCPUHandler
    from kvtier.tiers.remote.options import ClientOptions

    if ClientOptions(tier_options["url"]).parsed.cluster:
        return None
    n = hop_blocks(block_bytes, total_bytes, least=8)
    prefix = f"{tier_options.get('key_prefix') or 'kvt'}:{BENCH_SUFFIX}"
    options = {k: v for k, v in tier_options.items() if k not in ("fingerprint",)} | {"key_prefix": prefix}
    remote = ValkeyBackend("bench-remote", n, block_bytes, 0, fingerprint="kvtier-bench",
                           layout=f"block_bytes={block_bytes}", **options)
    memory = MemoryBackend("bench-mem", 2 * n, block_bytes)
    threads = remote.num_threads
    raw = _raw_client(remote.client_options())
    tiers = ({memory.name: memory}, {remote.name: remote})
    store_h, load_h = CPUToRemoteHandler(*tiers, threads), RemoteToCPUHandler(*tiers, threads)
    pool = ThreadPoolExecutor(max_workers=threads)
    try:
        for slot in range(n):
            memory.view(slot)[:] = os.urandom(block_bytes)
        keys = [make_offload_key(b"bench%03d" % (block_bytes % 997) + i.to_bytes(8, "big"), 0) for i in range(n)]
        parts, store_jobs, load_jobs = _jobs(threads, keys, memory, remote)
        rounds = _RawRounds(raw, [f"{prefix}:raw:{block_bytes}:{i}".encode() for i in range(n)],
                            [bytes(memory.view(i)) for i in range(n)], parts, pool, block_bytes)  # bytes: SET's fastest
        times: dict[str, list[float]] = {name: [] for name in
                                         ("raw_set_1", "raw_set_n", "store", "raw_get_1", "raw_get_n", "load")}
        for _ in range(repeats):
            times["raw_set_1"].append(rounds.run("set", threaded=False))
            times["raw_set_n"].append(rounds.run("set", threaded=True))
            times["store"].append(_timed_jobs(store_h, store_jobs))
            times["raw_get_1"].append(rounds.run("get", threaded=False))
            times["raw_get_n"].append(rounds.run("get", threaded=True))
            times["load"].append(_timed_jobs(load_h, load_jobs))
        _verify(memory, n, block_bytes)
        figures = _figures(times, n, block_bytes, threads, repeats)
    finally:
        pool.shutdown()
        store_h.shutdown()
        load_h.shutdown()
        remote.close()
        removed, error = remove_bench_keys(raw, prefix)
        raw.close()
        memory.close()
    return {**figures, "removed_keys": removed, "cleanup_error": error}


def remote_rows(figures: dict[str, Any], url: str) -> list[dict[str, Any]]:
    """The two hop rows (store, load) of one `measure_cpu_remote` result, with its raw baselines."""
    common = {"block_bytes": figures["block_bytes"], "total_bytes": figures["total_bytes"],
              "threads": figures["threads"], "url": url, "removed_keys": figures["removed_keys"],
              "cleanup_error": figures["cleanup_error"]}
    return [
        {"hop": "CPU->REMOTE", **common, "gbps": figures["store_gbps"], "baseline": "raw client SET",
         "baseline_gbps": figures["raw_set_gbps"], "paired_ratio": figures["store_vs_raw_paired"]},
        {"hop": "REMOTE->CPU", **common, "gbps": figures["load_gbps"], "baseline": "raw client GET+copy",
         "baseline_gbps": figures["raw_get_gbps"], "paired_ratio": figures["load_vs_raw_paired"]},
    ]
