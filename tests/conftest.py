"""Shared fixtures: small hierarchies built from YAML text, keys, request contexts."""

from __future__ import annotations

import pytest

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


@pytest.fixture
def ctx():
    return ReqContext("req-0")
