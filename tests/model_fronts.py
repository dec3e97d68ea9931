"""The front-ends the cross-front-end model test drives (tests/test_model_frontends.py), each over a
real CPU tier and a real file tier, with real bytes and no engine:

- `StandaloneFront`: `kvtier.standalone.KVTier` over CPU tensors as the KV cache;
- `VllmFront`: the vLLM adapter's scheduler side (`KVTierOffloadingManager`, adopted as
  `KVTierOffloadingConnector` does: file tiers loaded directly) with its worker side
  (`KVTierOffloadingWorker`) over CPU tensors, failed loads completed as the connector completes
  them: the keys the worker names (`take_failure`) to `complete_failed_load`.

Both offer one small API: `store`, `load` (the bytes of every block it loads are checked against
`content(key)` there), `lookup`, `flush`, `reopen` (close, then a new process on the same
`root_dir`), `stats`, and `tiers` (the manager's tiers, for the model's inspections).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from kvtier.config import parse_config
from kvtier.standalone import KVTier

PAGE = 4096  # bytes of one block (one engine block, one KV tensor)
CPU_BLOCKS, FILE_BLOCKS = 4, 24
SOURCE, SCRATCH = 0, 32  # engine blocks: where stores read from (one per key) and loads write to
ENGINE_BLOCKS = 64
CLOSE_BOUND_S = 30.0  # close() must return within this (nothing hangs here: a far looser bound than the real one)


def content(key: bytes) -> torch.Tensor:
    """The bytes every copy of `key` holds (a block filled from the key's hash)."""
    seed = hashlib.blake2b(key, digest_size=8).digest()
    return torch.frombuffer(bytearray((seed * (PAGE // 8))[:PAGE]), dtype=torch.int8)


def tiers_config(root: Path) -> dict[str, Any]:
    """The hierarchy both front-ends run: a small CPU tier cascading `on_evict` (the default) over
    a file tier that holds every key of the model's universe (nothing falls out of the hierarchy)."""
    return {"tiers": [
        {"name": "cpu", "backend": "cpu", "capacity": f"{CPU_BLOCKS} blocks", "pin": False, "cascade": "on_evict",
         "reserve": 0.25},
        {"name": "disk", "backend": "file", "root_dir": str(root), "capacity": f"{FILE_BLOCKS} blocks",
         "sync_interval": 0}]}


class _Engine:
    """The KV cache (CPU tensors): source blocks filled with each key's content before a store."""

    def __init__(self) -> None:
        self.kv = torch.zeros((ENGINE_BLOCKS, PAGE), dtype=torch.int8)

    def fill(self, keys: list[bytes], first: int = SOURCE) -> list[int]:
        for i, key in enumerate(keys):
            self.kv[first + i] = content(key)
        return list(range(first, first + len(keys)))

    def check(self, keys: list[bytes], first: int = SCRATCH) -> None:
        for i, key in enumerate(keys):
            assert torch.equal(self.kv[first + i], content(key)), f"key {key.hex()}: wrong bytes served"


class StandaloneFront:
    name = "standalone"

    def __init__(self, root: Path) -> None:
        self.root, self.engine = root, _Engine()
        self._lock = threading.Lock()  # (two threads storing: each fills its own source blocks)
        self.tier = self._open()

    def _open(self) -> KVTier:
        kv = CanonicalKVCaches([CanonicalKVCacheTensor(self.engine.kv, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])
        return KVTier.open(parse_config(tiers_config(self.root)), kv, model="test/model-frontends")

    @property
    def tiers(self) -> list[Any]:
        return self.tier.hierarchy.manager.tiers

    def store(self, keys: list[bytes], first: int = SOURCE) -> bool:
        return self.tier.store(keys, self.engine.fill(keys, first))

    def load(self, keys: list[bytes]) -> int:
        n = self.tier.load(keys, list(range(SCRATCH, SCRATCH + len(keys))))
        self.engine.check(keys[:n])
        return n

    def lookup(self, keys: list[bytes]) -> int:
        return self.tier.lookup(keys)

    def flush(self) -> int:
        return self.tier.flush(timeout=30)

    def stats(self) -> dict[str, Any]:
        return self.tier.stats()

    def reopen(self) -> float:
        start = time.monotonic()
        self.tier.close()
        took = time.monotonic() - start
        self.tier = self._open()
        return took

    def close(self) -> None:
        self.tier.close()


class SharedFront(StandaloneFront):
    """`KVTier` with `shared: host`: the same program through the host owner's hierarchy (an
    in-process `HostOwner`, a `SharedKVTier` over the socket). Between operations the front holds
    the namespace's lock, so that the model inspects the owner's tiers while nothing changes them;
    `reopen` closes the engine and the owner (which writes its CPU tier down) and starts both again."""

    name = "shared"

    def __init__(self, root: Path) -> None:
        self._ops = 0  # operations running (two threads may store at once)
        self._ops_lock = threading.Lock()
        self.owner: Any = None
        super().__init__(root)

    def _open(self) -> Any:
        from kvtier.host.owner import HostOwner

        socket = str(self.root.parent / "run" / "host.sock")
        self.owner = HostOwner(socket, lease_grace_s=0.0)
        config = parse_config({**tiers_config(self.root), "shared": {"socket": socket, "timeout_ms": 10_000}})
        kv = CanonicalKVCaches([CanonicalKVCacheTensor(self.engine.kv, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])
        # (the model names the host namespace, hence its CPU region in /dev/shm: one per test process,
        # so that two runs of this test at once on one machine do not refuse each other's region)
        tier = KVTier.open(config, kv, model=f"test/model-frontends-{os.getpid()}")
        self.namespace = next(iter(self.owner.namespaces.values()))
        self.namespace.lock.acquire()
        return tier

    @contextmanager
    def _op(self) -> Iterator[None]:
        """Let the owner work while an operation runs (the first one in releases its lock, the last out takes it)."""
        with self._ops_lock:
            self._ops += 1
            if self._ops == 1:
                self.namespace.lock.release()
        try:
            yield
        finally:
            with self._ops_lock:
                self._ops -= 1
                if self._ops == 0:
                    self.namespace.lock.acquire()

    @property
    def tiers(self) -> list[Any]:
        return self.namespace.manager.tiers

    def store(self, keys: list[bytes], first: int = SOURCE) -> bool:
        with self._op():
            return super().store(keys, first)

    def load(self, keys: list[bytes]) -> int:
        with self._op():
            return super().load(keys)

    def lookup(self, keys: list[bytes]) -> int:
        with self._op():
            return super().lookup(keys)

    def flush(self) -> int:
        with self._op():
            return super().flush()

    def stats(self) -> dict[str, Any]:
        with self._op():
            return super().stats()

    def reopen(self) -> float:
        start = time.monotonic()
        self._close_both()
        took = time.monotonic() - start
        self.tier = self._open()
        return took

    def _close_both(self) -> None:
        self.tier.close()
        self.namespace.lock.release()
        self.owner.close()

    def close(self) -> None:
        self._close_both()


class VllmFront:
    """vLLM's scheduler side and worker side in one process (vLLM's "uni" executor), driven the way
    vLLM's offloading connector drives them: stores offered a few blocks per step (a None answer
    is asked again next step), lookups scanning keys in order until a non-HIT (RETRY waits a step),
    a load job per request, a failure completed with the keys the worker names."""

    name = "vllm"
    PER_STEP = 2  # blocks a step offers at most (a request's new blocks per step)

    def __init__(self, root: Path) -> None:
        self.root, self.engine, self.jobs = root, _Engine(), 0
        self.loaded = 0  # blocks loaded since the last (re)open (the vLLM adapter counts no engine totals)
        self._open()

    def _open(self) -> None:
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef as Ref
        from vllm.v1.kv_offload.base import CanonicalKVCaches as Caches
        from vllm.v1.kv_offload.base import CanonicalKVCacheTensor as Tensor

        engine_id = f"model-{time.time_ns()}"
        caches = Caches([Tensor(self.engine.kv, PAGE)], [[Ref(0, PAGE)]])
        self.worker = _spec(self.root, engine_id).get_worker(caches)  # (registers the KV caches first, as vLLM does)
        self.manager = _spec(self.root, engine_id).get_manager()
        self.manager.direct_file_loads.enable()  # (what KVTierOffloadingConnector does)
        self.loaded = 0

    @property
    def tiers(self) -> list[Any]:
        return self.manager.hierarchy.manager.tiers

    def _ctx(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self.jobs += 1
        return ReqContext(f"r{self.jobs}")

    def _job(self) -> int:
        self.jobs += 1
        return self.jobs

    def _step(self) -> None:
        self.manager.on_schedule_end(None)
        time.sleep(0.001)

    def store(self, keys: list[bytes], first: int = SOURCE) -> bool:
        with self.manager.lock:
            return self._store(keys, first)

    def _store(self, keys: list[bytes], first: int) -> bool:
        ids = dict(zip(keys, self.engine.fill(keys, first)))
        ctx = self._ctx()
        for i in range(0, len(keys), self.PER_STEP):
            offer = keys[i:i + self.PER_STEP]
            out = self.manager.prepare_store(offer, ctx)
            for _ in range(2000):  # (vLLM asks again next step; copies down make the room)
                if out is not None:
                    break
                self._step()
                out = self.manager.prepare_store(offer, ctx)
            if out is None:
                return False
            if out.keys_to_store:
                self._run_store(list(out.keys_to_store), out.store_spec, ids, ctx)
        self.manager.on_request_finished(ctx)
        return True

    def _run_store(self, keys: list[bytes], spec: Any, ids: dict[bytes, int], ctx: Any) -> None:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        job = self._job()
        assert self.worker.submit_store(job, GPULoadStoreSpec([ids[k] for k in keys], group_sizes=[len(keys)],
                                                              block_indices=[0]), spec)
        self.worker.wait({job})
        results = self.worker.get_finished()
        assert [r.job_id for r in results] == [job]
        self.manager.complete_store(keys, ctx, success=results[0].success)

    def lookup(self, keys: list[bytes]) -> int:
        with self.manager.lock:
            ctx = self._ctx()
            n = self._lookup(keys, ctx)
            self.manager.on_request_finished(ctx)
            return n

    def _lookup(self, keys: list[bytes], ctx: Any) -> int:
        from vllm.v1.kv_offload.base import LookupResult

        for _ in range(2000):
            hits = 0
            for key in keys:
                answer = self.manager.lookup(key, ctx)
                if answer is not LookupResult.HIT:
                    break
                hits += 1
            else:
                return hits
            if answer not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                return hits
            self._step()
        return hits

    def load(self, keys: list[bytes]) -> int:
        with self.manager.lock:
            ctx = self._ctx()
            n = self._lookup(keys, ctx)
            n = self._load(keys[:n], ctx) if n else 0
            self.manager.on_request_finished(ctx)
        self.engine.check(keys[:n])
        self.loaded += n
        return n

    def _load(self, keys: list[bytes], ctx: Any) -> int:
        """One load job of `keys` (each a HIT); how many leading ones were loaded."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        job = self._job()
        src = self.manager.prepare_load(keys, ctx)
        dst = GPULoadStoreSpec(list(range(SCRATCH, SCRATCH + len(keys))), group_sizes=[len(keys)], block_indices=[0])
        assert self.worker.submit_load(job, src, dst)
        self.worker.wait({job})
        (result,) = self.worker.get_finished()
        if result.success:
            self.manager.complete_load(set(keys), ctx)
            return len(keys)
        bad, first = self.worker.take_failure(job)  # (what the connector reports and completes)
        self.manager.complete_failed_load(set(keys), ctx, None if bad is None else set(bad))
        return first

    def flush(self) -> int:
        with self.manager.lock:
            return self.manager.hierarchy.manager.flush(30)

    def stats(self) -> dict[str, Any]:
        return {**self.manager.tier_stats(), "engine": {"loads": self.loaded}}

    def reopen(self) -> float:
        start = time.monotonic()
        self.close()
        took = time.monotonic() - start
        self._open()
        return took

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


def _spec(root: Path, engine_id: str) -> Any:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "integration"))
    from test_vllm_spec import _config

    from kvtier.integrations.vllm import KVTierOffloadingSpec

    return KVTierOffloadingSpec(_config(root, events=False, kvtier_config=tiers_config(root), engine_id=engine_id,
                                        page=PAGE, blocks_per_chunk=1))
