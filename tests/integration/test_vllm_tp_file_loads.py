"""Direct file loads from worker processes (issue 38), without an engine: the scheduler-side
manager in this process, each worker rank in a process of its own (test_vllm_tp.py's `Ranks`), as
vLLM's "mp" executor runs them (TP = 1: one worker process; TP = 2: two).

The scheduler hands out file-tier slots (keys, tier identity, no path); each rank opens the file
tier read-only from its own config, reads its part of each slot and verifies exactly those bytes
(the slot's part checksums). One rank's part corrupted on disk fails that block on that rank
only; the failures, merged over the ranks as vLLM merges worker metadata, drop that block alone;
the KV pages of the failed block stay untouched on that rank. (The same with a real TP = 2
engine: test_vllm_tp_direct_e2e.py.)
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_tp import BPC, PAGE, Ranks, _config, _keys, _settle  # noqa: E402


def _corrupt_part(backend, slot: int, rank: int, rank_bytes: int) -> None:
    """Flip one payload byte inside rank `rank`'s part of `slot` on disk."""
    from kvtier.tiers.file.slot_format import HEADER_BYTES

    with open(backend.slab_path, "r+b") as f:
        at = slot * backend.slot_bytes + HEADER_BYTES + rank * rank_bytes + 11
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def _merged_failure(failures: dict[int, tuple]) -> list[bytes] | None:
    """The job's failed keys over the ranks, as `KVTierWorkerMetadata.aggregate` merges them."""
    from kvtier.integrations.vllm.connector import merge_failures

    merged: list[bytes] | None = []
    for bad, _first in failures.values():
        merged = merge_failures(merged, bad)
    return merged


@pytest.mark.parametrize("world", [1, 2])
def test_worker_processes_load_file_blocks_each_verifying_its_part(tmp_path, world):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm import KVTierOffloadingSpec
    from kvtier.integrations.vllm.spec import vllm_has_sync_loads
    from kvtier.integrations.vllm.translate import KVTierFileLoadStoreSpec

    engine_id = f"tp-file-{world}-{time.time_ns()}"
    ranks = Ranks(str(tmp_path), engine_id, world=world, cpu_blocks=2)
    config = _config(str(tmp_path), engine_id, world_size=world, cpu_blocks=2)
    if vllm_has_sync_loads():  # (vLLM 0.33: direct loads are asked for; the workers serve what they get)
        config.extra_config["direct_file_loads"] = True
    spec = KVTierOffloadingSpec(config)
    ctx, manager = ReqContext("r-file"), None
    try:
        manager = spec.get_manager()
        assert manager.direct_file_loads.enable()  # (what KVTierOffloadingConnector does)
        disk = manager.manager.tiers[1]
        assert disk.backend.part_checks == world
        old, new = _keys(2), _keys(2, start=10)
        for job_id, keys, blocks in ((1, old, [1, 2, 3, 4]), (2, new, [5, 6, 7, 8])):
            out = manager.prepare_store(keys, ctx)
            assert ranks.run("store", job_id, blocks, out.store_spec)[0] == {job_id}
            manager.complete_store(keys, ctx)
            _settle(manager)  # written through to the file tier; `new` pushes `old` out of the CPU tier
        assert manager.manager.tiers[0].readable(old[0]) is None and disk.readable(old[0]) is not None
        pages = [ranks.pages(rank, [1, 2, 3, 4]) for rank in range(world)]

        assert [manager.lookup(k, ctx) for k in old] == [LookupResult.HIT] * 2  # no RETRY: no promotion
        load = manager.prepare_load(old, ctx)
        assert isinstance(load, KVTierFileLoadStoreSpec) and load.identity == disk.backend.digest
        done, loaded = ranks.run("load", 3, [8, 9, 10, 11], load)
        assert done == {3} and ranks.failed == {}
        assert [loaded[r] == pages[r] for r in range(world)] == [True] * world  # each rank its own bytes
        manager.complete_load(old, ctx)
        stats = manager.tier_stats()
        assert (stats["disk"]["hits"], stats["disk"]["promotions"]) == (2, 0)

        _corrupt_part(disk.backend, disk.policy.get(old[1]).block_id, world - 1, spec.rank_bytes)  # the last rank's
        load = manager.prepare_load(old, ctx)
        done, loaded = ranks.run("load", 4, [8, 9, 10, 11], load)
        assert done == {4}  # (a failed job completes: vLLM must let its request go)
        assert ranks.failed[4] == {world - 1: ([bytes(old[1])], 1)}  # that rank alone names that block alone
        assert loaded[world - 1][:2] == pages[world - 1][:2]  # its good block loaded...
        assert loaded[world - 1][2:] == [bytes(PAGE)] * BPC  # ...the bad one's pages untouched (wiped before)
        assert all(loaded[r] == pages[r] for r in range(world - 1))  # the other ranks' parts verified and loaded
        manager.complete_failed_load(old, ctx, _merged_failure(ranks.failed[4]))
        assert [manager.lookup(k, ctx) for k in old] == [LookupResult.HIT, LookupResult.MISS]
        assert manager.tier_stats()["disk"]["failures"] == 1
    finally:
        ranks.close()
        if manager is not None:
            manager.shutdown()
    assert all(proc.exitcode == 0 for proc in ranks.procs), [proc.exitcode for proc in ranks.procs]

