"""Tensor parallelism and the shared tier through the vLLM adapter, without an engine: a TP=2
engine's scheduler (this process) publishes each block as one value per rank on a real
Valkey/Redis server, each value holding exactly that rank's bytes, and a second TP=2 engine (a
new CPU region, new rank processes) finds the blocks with a probe and loads both ranks' bytes
back byte-exact. The rank processes and vLLM's completion counting are test_vllm_tp's."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _spec(root: str, engine_id: str, url: str, prefix: str):
    from test_vllm_tp import _config

    from kvtier.integrations.vllm import KVTierOffloadingSpec

    tiers = [{"name": "cpu", "backend": "cpu", "capacity": "8 blocks"},
             {"name": "shared", "backend": "valkey", "capacity": "64 blocks", "url": url, "key_prefix": prefix,
              "timeout_ms": 2000}]
    return KVTierOffloadingSpec(dataclasses.replace(_config(root, engine_id), extra_config={"kvtier_config":
                                                                                           {"tiers": tiers}}))


def test_tp2_engines_share_blocks_one_value_per_rank(tmp_path, valkey_server):
    from test_vllm_tp import BPC, WORLD, Ranks, _keys, _settle
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    prefix = f"kvt:tp{time.time_ns()}"
    ctx = ReqContext("r-tp-shared")
    whole = _keys(2)
    # Engine A: its two ranks store engine blocks 1..4 (two offloaded blocks); the scheduler publishes.
    ranks = Ranks(str(tmp_path), "tps-a")
    spec = _spec(str(tmp_path), "tps-a", valkey_server.url, prefix)
    assert spec.hierarchy_config.tiers[1].options["tp"] == WORLD
    manager = spec.get_manager()
    try:
        out = manager.prepare_store(whole, ctx)
        done, _ = ranks.run("store", 1, [1, 2, 3, 4], out.store_spec)
        assert done == {1}
        manager.complete_store(whole, ctx)
        manager.manager.wait_idle(30)
        pages = [ranks.pages(rank, [1, 2, 3, 4]) for rank in range(WORLD)]
    finally:
        ranks.close()
        manager.shutdown()
    assert manager.manager.get_stats()["shared"]["stores"] == 2

    # On the server: block i is WORLD values, value r holding rank r's pages of that block.
    client = valkey_server.client()
    for i, key in enumerate(whole):
        tail = b":%s:0" % key[:-4].hex().encode()
        parts = sorted(k for k in client.scan_iter(match=f"{prefix}:*") if k.endswith(tail))
        assert [p.split(b":")[-3] for p in parts] == [b"%dof%d" % (r, WORLD) for r in range(WORLD)]
        for rank, part in enumerate(parts):
            assert client.get(part)[:-44] == b"".join(pages[rank][BPC * i:BPC * (i + 1)]), (i, rank)

    # Engine B: its own CPU region and ranks; a probe finds the blocks, both ranks load their bytes.
    ranks = Ranks(str(tmp_path), "tps-b")
    spec = _spec(str(tmp_path), "tps-b", valkey_server.url, prefix)
    manager = spec.get_manager()
    try:
        assert [manager.lookup(k, ctx) for k in whole] == [LookupResult.RETRY] * 2
        deadline = time.monotonic() + 30
        while [manager.lookup(k, ctx) for k in whole] != [LookupResult.HIT] * 2:
            assert time.monotonic() < deadline, "the published blocks were not found"
            _settle(manager)
            manager.manager.wait_idle(5)
        load_spec = manager.prepare_load(whole, ctx)
        done, loaded = ranks.run("load", 2, [8, 9, 10, 11], load_spec)
        assert done == {2}
        manager.complete_load(whole, ctx)
        for rank in range(WORLD):
            assert loaded[rank] == pages[rank], rank
        assert manager.manager.get_stats()["shared"]["probe_hits"] == 2
    finally:
        ranks.close()
        manager.shutdown()
