"""Shared fixtures: small hierarchies built from YAML text, keys, request contexts."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

# real Valkey/Redis servers for the shared tier's tests: valkey_server, valkey_cluster (session), private_server,
# private_cluster, make_store (tests/remote/servers.py)
from remote.servers import make_store, private_cluster, private_server, valkey_cluster, valkey_server  # noqa: F401

from kvtier import ReqContext, build_hierarchy, load_config_text, make_offload_key


def keys(n: int, start: int = 0, group: int = 0) -> list[bytes]:
    return [make_offload_key(i.to_bytes(8, "big"), group) for i in range(start, start + n)]


def memory_hierarchy(hot: int = 8, warm: int = 32, hot_policy: str = "lru", cascade: str = "on_evict",
                     block_bytes: int = 64, reserve: float = 0.25, **kwargs):
    """Two memory tiers (blocks carry real bytes) for manager tests."""
    text = f"""
block_bytes: {block_bytes}B
tiers:
  - {{name: hot, backend: memory, capacity: {hot} blocks, policy: {hot_policy}, cascade: {cascade}, reserve: {reserve}}}
  - {{name: warm, backend: memory, capacity: {warm} blocks, policy: lru}}
"""
    return build_hierarchy(load_config_text(text), **kwargs)


class Jobs:
    """Runs jobs on handlers directly (bound like the router binds them) and collects results."""

    def __init__(self, *handlers):
        self.results = {}
        self.handlers = handlers
        for h in handlers:
            h.bind(lambda r: self.results.__setitem__(r.job_id, r))

    def run(self, handler, job_id, src, dst):
        handler.submit(job_id, src, dst)
        handler.wait([job_id])
        return self.results[job_id]

    def close(self):
        for h in self.handlers:
            h.shutdown()


def flip(path, offset: int, mask: int = 0x01) -> None:
    """Flip bits of the byte at `offset` of a file in place (corruption tests)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


@pytest.fixture
def ctx():
    return ReqContext("req-0")


def lines_run(call: Callable[[], object]) -> int:
    """How many Python lines `call()` runs, in every frame it enters (a count, not a time)."""
    count = 0

    def tracer(frame, event, arg):  # noqa: ARG001 - the tracing protocol's signature
        nonlocal count
        count += event == "line"
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(previous)
    return count


@pytest.fixture
def vllm_stand_in(monkeypatch):
    """vLLM's manager replaced by one kvtier LRU tier of the capacity it is given (`replay_vllm`'s
    signature), so that `--compare vllm` runs without vLLM; the capacities it got, in order."""
    from kvtier.bench import replay
    from kvtier.config import parse_config

    seen: list[int] = []

    def stand_in(capacity_blocks, policy, trace, progress=None, store_threshold=0):
        seen.append(capacity_blocks)
        config = parse_config({"tiers": [{"name": "cpu", "backend": "memory",
                                          "capacity": f"{capacity_blocks} blocks", "policy": "lru"}]})
        result = replay.replay_kvtier(config, trace)
        result["tiers"] = {"cpu": {"hit_rate": result["hit_rate"], "capacity_blocks": capacity_blocks,
                                   "policy": policy}}
        return result

    monkeypatch.setattr("kvtier.bench.replay.vllm_available", lambda: True)
    monkeypatch.setattr("kvtier.bench.replay.replay_vllm", stand_in)
    return seen
