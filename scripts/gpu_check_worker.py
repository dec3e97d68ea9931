"""The vLLM worker's load and store path over KV tensors on a device, without an engine: vLLM's
real spec/config types, kvtier's `KVTierOffloadingSpec` (scheduler-side manager and worker, in
one process as vLLM's "uni" executor builds them), a CPU tier written through to a file tier.

    python scripts/gpu_check_worker.py [--device cuda|cpu] [--page 64KiB] [--json OUT.json]

Checks, each printed as one line (`ok` or `FAILED`, and what was seen):

1. store + load through the CPU tier: blocks stored from the engine, the engine wiped, loaded
   back, byte for byte;
2. the direct file load: blocks pushed out of the CPU tier (only in the file tier) are a HIT,
   loaded by the worker straight from the file tier and verified there, byte for byte;
3. a corrupted block: one payload byte flipped on disk; its load fails, nothing reaches the KV
   cache, the failed load drops the blocks it read (a MISS from then on), and a block stored
   afterwards loads fine.

Where vLLM does not import (the lent CUDA machines carry no vLLM build), `--api auto` (the
default) runs the same three checks through kvtier's standalone API instead (`KVTier`: the same
builder, worker plane and handlers over the same KV tensors; file-tier blocks come up the way
`io: auto` takes them there, and a corrupted block's load stops before it), and says so: the
vLLM worker's own code (spec translation, `FileLoads`) is then not what ran.

Exit status: 0 all passed, 1 one failed, 4 `--api vllm` and vLLM does not import (nothing run).
The CPU run (`--device cpu`, on the project's CI machine) checks the script; the CUDA run is what
scripts/gpu_check.sh reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any

BPC = 2  # engine blocks per offloaded block (a partly covered chunk is the tests' business)
ENGINE_BLOCKS = 16


def offloading_config(root: str, page: int, engine_id: str):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    tiers = {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "4 blocks", "cascade": "on_store"},
                       {"name": "disk", "backend": "file", "root_dir": f"{root}/disk", "capacity": "16 blocks"}]}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=page, enable_kv_cache_events=True,
        extra_config={"kvtier_config": tiers}, engine_id=engine_id,
        model=OffloadingModelConfig(name="gpu-check", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))
    from kvtier.integrations.vllm.spec import vllm_has_sync_loads

    if vllm_has_sync_loads():  # vLLM 0.33: direct file loads must be asked for
        config.extra_config["direct_file_loads"] = True
    return config


class Engine:
    """A worker over KV tensors on `device` and the scheduler-side manager, one engine."""

    def __init__(self, root: str, device: str, page: int):
        import torch
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

        from kvtier.integrations.vllm import KVTierOffloadingSpec

        engine_id = f"gpu-check-{time.time_ns()}"
        self.kv = torch.randint(-128, 127, (ENGINE_BLOCKS, page), dtype=torch.int8, device=device)
        caches = CanonicalKVCaches([CanonicalKVCacheTensor(self.kv, page)], [[CanonicalKVCacheRef(0, page)]])
        self.worker_spec = KVTierOffloadingSpec(offloading_config(root, page, engine_id))
        self.worker = self.worker_spec.get_worker(caches)
        self.spec = KVTierOffloadingSpec(offloading_config(root, page, engine_id))
        self.manager = self.spec.get_manager()
        if self.manager.direct_file_loads is not None:  # what KVTierOffloadingConnector does
            self.manager.direct_file_loads.enable()
        self.stored: dict = {}
        self.page = page

    def gpu(self, first: int, n_keys: int):
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        n = n_keys * BPC
        return GPULoadStoreSpec(list(range(first, first + n)), group_sizes=[n], block_indices=[0])

    def settle(self, timeout: float = 20.0) -> None:
        end = time.time() + timeout
        while self.manager.has_pending_work() and time.time() < end:
            self.manager.on_schedule_end(None)
            time.sleep(0.01)

    def store(self, keys, first: int, ctx, job_id: int = 1) -> None:
        out = self.manager.prepare_store(keys, ctx)
        assert self.worker.submit_store(job_id, self.gpu(first, len(keys)), out.store_spec)
        self.worker.wait({job_id})
        results = self.worker.get_finished()
        assert results and all(r.success for r in results), f"store failed: {results}"
        self.manager.complete_store(keys, ctx)
        self.settle()
        for i, key in enumerate(keys):
            self.stored[key] = self.kv[first + i * BPC:first + (i + 1) * BPC].clone()

    def load(self, keys, first: int, ctx, job_id: int = 2):
        spec = self.manager.prepare_load(keys, ctx)
        assert self.worker.submit_load(job_id, spec, self.gpu(first, len(keys)))
        self.worker.wait({job_id})
        (result,) = self.worker.get_finished()
        return spec, result

    def loaded_equal(self, keys, first: int) -> bool:
        import torch

        return all(torch.equal(self.kv[first + i * BPC:first + (i + 1) * BPC], self.stored[k])
                   for i, k in enumerate(keys))

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


def keys_from(start: int, n: int):
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


def load_checked(engine: Engine, keys, ctx, source: type) -> Any:
    """Wipe engine blocks 8.., load `keys` there from a spec of type `source`, check every byte."""
    engine.kv[8:8 + len(keys) * BPC].zero_()
    spec, result = engine.load(keys, 8, ctx)
    assert isinstance(spec, source), f"loaded from {type(spec).__name__}, not {source.__name__}"
    assert result.success, "the load failed"
    assert engine.loaded_equal(keys, 8), "the loaded bytes differ from the stored ones"
    engine.manager.complete_load(keys, ctx)
    return result


def through_the_cpu_tier(engine: Engine, ctx) -> str:
    from kvtier.integrations.vllm.translate import KVTierCPULoadStoreSpec

    keys = keys_from(100, 2)
    engine.store(keys, 0, ctx)
    result = load_checked(engine, keys, ctx, KVTierCPULoadStoreSpec)
    return f"{len(keys)} blocks ({result.transfer_size} B) stored and loaded back byte for byte"


def direct_file_load(engine: Engine, ctx) -> str:
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm.translate import KVTierFileLoadStoreSpec

    keys = keys_from(200, 2)
    engine.store(keys, 0, ctx)
    engine.store(keys_from(210, 4), 4, ctx, job_id=3)  # pushes `keys` out of the 4-block CPU tier
    assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 2, "not a HIT from the file tier"
    load_checked(engine, keys, ctx, KVTierFileLoadStoreSpec)
    return f"{len(keys)} file-only blocks loaded by the worker straight from the file tier, byte for byte"


def flip_payload_byte(tier, key) -> None:
    """Flip one payload byte of `key`'s slot in the file tier `tier`, on disk."""
    from kvtier.tiers.file.slot_format import HEADER_BYTES

    offset = tier.policy.get(key).block_id * tier.backend.slot_bytes + HEADER_BYTES + 5
    with open(tier.backend.slab_path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def corrupted_block(engine: Engine, ctx) -> str:
    from vllm.v1.kv_offload.base import LookupResult

    keys = keys_from(300, 2)
    engine.store(keys, 0, ctx)
    engine.store(keys_from(310, 4), 4, ctx, job_id=3)
    flip_payload_byte(engine.manager.hierarchy.manager.tiers[1], keys[1])
    engine.kv.zero_()
    _, result = engine.load(keys, 8, ctx)
    assert not result.success, "the load of a corrupted block succeeded"
    assert not bool(engine.kv.any()), "bytes reached the KV cache from a load that failed verification"
    engine.manager.complete_failed_load(keys, ctx)
    assert [engine.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2, "the bad blocks are still served"
    later = keys_from(330, 1)
    engine.store(later, 0, ctx, job_id=4)
    engine.kv[8:8 + BPC].zero_()
    _, again = engine.load(later, 8, ctx, job_id=5)
    assert again.success and engine.loaded_equal(later, 8), "a block stored after the failure did not load"
    return "its load failed, the KV cache untouched, both blocks dropped (MISS), a later block loads fine"


STANDALONE_YAML = """tiers:
  - {{name: cpu, backend: cpu, capacity: 4 blocks, cascade: on_store}}
  - {{name: disk, backend: file, root_dir: '{root}/disk', capacity: 16 blocks}}
"""


class Standalone:
    """The same checks through `kvtier.KVTier` over KV tensors on `device` (no vLLM)."""

    def __init__(self, root: str, device: str, page: int):
        import torch

        from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, KVTier, load_config_text

        self.kv = torch.randint(-128, 127, (ENGINE_BLOCKS, page), dtype=torch.int8, device=device)
        caches = CanonicalKVCaches([CanonicalKVCacheTensor(self.kv, page)], [[CanonicalKVCacheRef(0, page)]])
        self.tier = KVTier.open(load_config_text(STANDALONE_YAML.format(root=root)), caches, BPC, model="gpu-check")
        self.stored: dict = {}

    def blocks(self, first: int, n_keys: int) -> list[int]:
        return list(range(first, first + n_keys * BPC))

    def store(self, keys, first: int) -> None:
        assert self.tier.store(keys, self.blocks(first, len(keys))), "store refused"
        self.tier.wait()
        for i, key in enumerate(keys):
            self.stored[key] = self.kv[first + i * BPC:first + (i + 1) * BPC].clone()

    def loaded_equal(self, keys, first: int) -> bool:
        import torch

        return all(torch.equal(self.kv[first + i * BPC:first + (i + 1) * BPC], self.stored[k])
                   for i, k in enumerate(keys))

    def file_tier(self):
        return self.tier.manager.tiers[1]

    def close(self) -> None:
        self.tier.close(flush=False)


def standalone_keys(start: int, n: int):
    from kvtier.core.keys import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


def standalone_cpu_tier(engine: Standalone) -> str:
    keys = standalone_keys(100, 2)
    engine.store(keys, 0)
    engine.kv[8:8 + 2 * BPC].zero_()
    assert engine.tier.load(keys, engine.blocks(8, 2)) == 2, "not every block loaded"
    assert engine.loaded_equal(keys, 8), "the loaded bytes differ from the stored ones"
    return "2 blocks stored and loaded back byte for byte"


def standalone_file_load(engine: Standalone) -> str:
    keys = standalone_keys(200, 2)
    engine.store(keys, 0)
    engine.store(standalone_keys(210, 4), 4)  # pushes `keys` out of the 4-block CPU tier
    assert engine.tier.manager.tiers[0].readable(keys[0]) is None, "still in the CPU tier"
    before = engine.tier.stats()["disk"]
    engine.kv[8:8 + 2 * BPC].zero_()
    assert engine.tier.load(keys, engine.blocks(8, 2)) == 2, "not every block loaded"
    assert engine.loaded_equal(keys, 8), "the loaded bytes differ from the stored ones"
    after = engine.tier.stats()["disk"]
    how = "promoted through the CPU tier" if after["promotions"] > before["promotions"] else "loaded directly"
    return f"2 file-only blocks {how} (io: auto here), byte for byte"


def standalone_corrupted(engine: Standalone) -> str:
    keys = standalone_keys(300, 2)
    engine.store(keys, 0)
    engine.store(standalone_keys(310, 4), 4)
    flip_payload_byte(engine.file_tier(), keys[1])
    engine.kv.zero_()
    loaded = engine.tier.load(keys, engine.blocks(8, 2))
    assert loaded < 2, "the corrupted block was loaded"
    assert not bool(engine.kv[8 + BPC:8 + 2 * BPC].any()), "bytes of the corrupted block reached the KV cache"
    dropped = engine.tier.lookup(keys[1:]) == 0
    assert engine.tier.load(keys[1:], engine.blocks(8 + BPC, 1)) == 0, "a second load served the corrupted block"
    assert not bool(engine.kv[8 + BPC:8 + 2 * BPC].any()), "bytes of the corrupted block reached the KV cache"
    later = standalone_keys(330, 1)
    engine.store(later, 0)
    engine.kv[8:8 + BPC].zero_()
    assert engine.tier.load(later, engine.blocks(8, 1)) == 1 and engine.loaded_equal(later, 8), "a later block"
    return (f"load stopped before it ({loaded} of 2 loaded), its KV untouched, never served again "
            f"({'dropped: MISS' if dropped else 'still indexed, each load fails verification'}), a later block loads")


def run_checks(api: str, root: str, device: str, page: int) -> list[dict]:
    """Each check of `api` ("vllm" or "standalone"): {check, ok, seen}, printed as it ends."""
    if api == "vllm":
        from vllm.v1.kv_offload.base import ReqContext

        engine: Any = Engine(root, device, page)
        checks = [(name, lambda c=check, n=name: c(engine, ReqContext(n))) for name, check in (
            ("store+load via CPU tier", through_the_cpu_tier), ("direct file load", direct_file_load),
            ("corrupted block", corrupted_block))]
    else:
        engine = Standalone(root, device, page)
        checks = [(name, lambda c=check: c(engine)) for name, check in (
            ("store+load via CPU tier", standalone_cpu_tier), ("file-tier load", standalone_file_load),
            ("corrupted block", standalone_corrupted))]
    rows = []
    try:
        for name, check in checks:
            try:
                rows.append({"check": f"{api} worker {name}", "ok": True, "seen": check()})
            except Exception as exc:  # noqa: BLE001 - report each check, go on
                rows.append({"check": f"{api} worker {name}", "ok": False, "seen": f"{type(exc).__name__}: {exc}"})
            row = rows[-1]
            print(f"{'ok' if row['ok'] else 'FAILED':<7} {row['check']} ({device}): {row['seen']}", flush=True)
    finally:
        engine.close()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--page", default="64KiB", help="bytes of one engine block's KV")
    parser.add_argument("--api", choices=("auto", "vllm", "standalone"), default="auto")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    api, why = args.api, ""
    if api != "standalone":
        try:
            import vllm.v1.kv_offload.base  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - anything that stops vLLM's import
            why = f"vllm.v1.kv_offload does not import here ({type(exc).__name__}: {exc})"
            if api == "vllm":
                print(f"no vLLM: {why}; nothing run")
                return 4
            print(f"note: {why}: the checks run through kvtier's standalone API, not vLLM's worker")
            api = "standalone"
        else:
            api = "vllm"
    from kvtier.config import parse_size

    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-check-") as root:
        rows = run_checks(api, root, args.device, parse_size(args.page))
    if args.json:
        with open(args.json, "w") as f:
            from kvtier.bench.provenance import provenance

            json.dump({**provenance(), "device": args.device, "api": api, "no_vllm": why, "rows": rows}, f, indent=2)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
