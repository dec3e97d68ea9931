"""Measurements of the remote store against the same client's raw commands, in the same run.

`data_path(url, block_bytes)`: raw redis-py SET of the block's bytes vs `write_block`, and raw GET +
copy into a preallocated buffer vs `read_block` (GET received into the buffer, verified there),
rounds interleaved so both see the same server and machine state; medians. `probe(url)`: `RemoteStore.probe` of 64 keys
(half present) vs a raw redis-py pipeline of the same EXISTS commands; p50 / p99.
Each returns a dict (figures in GB/s, microseconds, ratios) for `kvtier bench` rows and JSON.

    python -m kvtier.tiers.remote.bench --url redis://127.0.0.1:6379 [--json out.json]

writes its own keys under the prefix `kvtier-bench` and leaves them to the server's eviction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import redis

from kvtier.core.keys import make_offload_key
from kvtier.tiers.remote.nodes import connection_kwargs
from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.store import RemoteStore

PREFIX = "kvtier-bench"


def _store(url: str, block_bytes: int, tp: int = 1) -> RemoteStore:
    store = RemoteStore(ClientOptions(url), key_prefix=PREFIX, fingerprint="bench", layout=f"{block_bytes}x{tp}",
                        block_bytes=block_bytes, tp=tp)
    store.wait_ready(10.0)  # a cluster's slot map loads in the background; a bench may wait for it
    return store


def _raw_client(options: ClientOptions) -> redis.Redis:
    """The same client library and settings the store uses, for one server (single-node URLs)."""
    parsed = options.parsed
    if parsed.cluster:
        raise ValueError("url: the raw baseline needs a single-server URL (redis://, rediss://, unix://)")
    kwargs = connection_kwargs(options, parsed.tls)
    endpoint = parsed.endpoints[0]
    if endpoint.unix_path:
        kwargs.pop("socket_keepalive")
        return redis.Redis(unix_socket_path=endpoint.unix_path, db=parsed.db, **kwargs)
    return redis.Redis(host=endpoint.host, port=endpoint.port, db=parsed.db, ssl=parsed.tls, **kwargs)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def data_path(url: str, block_bytes: int, *, rounds: int = 30, blocks: int = 8) -> dict:
    """Write and read throughput of the store vs the raw client for blocks of `block_bytes` (module doc)."""
    store = _store(url, block_bytes)
    raw = _raw_client(store.options)
    try:
        payloads = [os.urandom(block_bytes) for _ in range(blocks)]
        keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(blocks)]
        raw_keys = [f"{PREFIX}:raw:{block_bytes}:{i}".encode() for i in range(blocks)]
        out = bytearray(block_bytes)
        out_view = memoryview(out)
        times: dict[str, list[float]] = {"raw_set": [], "write": [], "raw_get": [], "read": []}

        def raw_get(k: bytes) -> None:
            value = raw.get(k)
            assert isinstance(value, bytes)
            out_view[:] = value

        for _ in range(rounds):
            for key, raw_key, payload in zip(keys, raw_keys, payloads):
                times["raw_set"].append(_timed(lambda: raw.set(raw_key, payload)))  # noqa: B023 - called at once
                times["write"].append(_timed(lambda: store.write_block(key, memoryview(payload))))  # noqa: B023
            for key, raw_key in zip(keys, raw_keys):
                times["raw_get"].append(_timed(lambda: raw_get(raw_key)))  # noqa: B023
                times["read"].append(_timed(lambda: store.read_block(key, out_view)))  # noqa: B023
        med = {name: statistics.median(t) for name, t in times.items()}
        gbps = {name: block_bytes / t / 1e9 for name, t in med.items()}
        return {"block_bytes": block_bytes, "ops_each": rounds * blocks,
                **{f"{name}_gbps": round(v, 3) for name, v in gbps.items()},
                **{f"{name}_us_p50": round(t * 1e6, 1) for name, t in med.items()},
                "write_vs_raw_set": round(gbps["write"] / gbps["raw_set"], 3),
                "read_vs_raw_get": round(gbps["read"] / gbps["raw_get"], 3)}
    finally:
        raw.close()
        store.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def probe(url: str, *, keys: int = 64, repeats: int = 500, tp: int = 1) -> dict:
    """p50 / p99 of one `probe` of `keys` keys (half present) vs a raw pipeline of the same EXISTS."""
    store = _store(url, 4096, tp)
    try:
        names = [make_offload_key(i.to_bytes(8, "big"), 1) for i in range(keys)]
        for block_key in names[::2]:
            store.write_block(block_key, memoryview(bytes(4096)))
        parts = store.keys.all_part_keys(names)
        raw = _raw_client(store.options) if not store.options.parsed.cluster else None

        def raw_probe() -> None:
            assert raw is not None
            pipe = raw.pipeline(transaction=False)
            for p in parts:
                pipe.exists(p)
            pipe.execute()

        samples: dict[str, list[float]] = {"probe": [], "raw_pipeline": []}
        for _ in range(repeats):
            samples["probe"].append(_timed(lambda: store.probe(names)))
            if raw is not None:
                samples["raw_pipeline"].append(_timed(raw_probe))
        if raw is not None:
            raw.close()
        result: dict = {"keys": keys, "tp": tp, "repeats": repeats, "servers": store.stats()["servers"]}
        for name, values in samples.items():
            if values:
                result[f"{name}_us_p50"] = round(_percentile(values, 0.5) * 1e6, 1)
                result[f"{name}_us_p99"] = round(_percentile(values, 0.99) * 1e6, 1)
        return result
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a server (redis://...), or a cluster for the probe only")
    parser.add_argument("--sizes", default="262144,1048576", help="block sizes in bytes, comma-separated")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results: dict = {"url": args.url, "probe": probe(args.url)}
    if not ClientOptions(args.url).parsed.cluster:
        results["data_path"] = [data_path(args.url, int(s)) for s in args.sizes.split(",")]
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
