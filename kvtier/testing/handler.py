"""`HandlerTests`: the conformance suite every `TransferHandler` pair must pass.

A test class subclasses `HandlerTests` for one (source spec type, destination spec type) pair and
says how to build both sides (`make_sides`); by default the handlers come from the registry
(`kvtier.transfer.registry.handler_factory`), so the suite checks what a hierarchy would really use:

    class TestMyPair(HandlerTests):
        def make_sides(self, tmp_path):
            return HostSlotSide(MemoryBackend("a", 16, 256)), MySide(...)

A *side* is one end of a hop: it builds specs for some locations (engine blocks or tier slots),
fills locations with fresh bytes and reads them back. The forward handler copies source -> destination,
the backward handler destination -> source. What the suite asserts:

- a round trip (source -> destination -> fresh source locations) returns the same bytes;
- a load into the engine whose first block starts inside an offloaded block (`block_indices`)
  writes exactly the covered sub-blocks (pairs with an engine side);
- a job that cannot be done reports `TransferResult(success=False)` instead of raising;
- every submitted job is reported exactly once, and `wait` returns only after its jobs are reported.

Sides shipped here: `HostSlotSide` (a backend with `view(slot)`), `FileSlotSide` (a backend with
`write_blocks`/`read_blocks`), `RemoteSlotSide` (a shared tier's handles, `put_blocks`/`get_blocks`),
`EngineSide` (the engine's KV cache as CPU tensors).
"""

from __future__ import annotations

import random
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.core.keys import make_offload_key
from kvtier.core.specs import GPULoadStoreSpec, LoadStoreSpec
from kvtier.core.types import TransferResult
from kvtier.transfer import registry
from kvtier.transfer.handlers.base import TransferHandler

__all__ = ["EngineSide", "FileSlotSide", "HandlerTests", "HostSlotSide", "JobCollector", "RemoteSlotSide", "Side"]


class Side(ABC):
    """One end of a hop. A location is an engine block or a tier slot; one offloaded block spans
    `span` locations (engine blocks per offloaded block; 1 for tiers)."""

    span: int = 1
    spec_type: type[LoadStoreSpec]
    #: backends by name (what the registry's factories receive), and the engine's KV caches or None
    backends: dict[str, Any]
    kv_caches: Any = None

    @property
    @abstractmethod
    def num_locations(self) -> int:
        """How many locations exist (valid ids are 0 .. num_locations - 1)."""

    @abstractmethod
    def spec(self, ids: Sequence[int], keys: Sequence[bytes],
             block_indices: Sequence[int] | None = None) -> LoadStoreSpec:
        """A spec for `ids` (`span` ids per key of `keys`, in order)."""

    @abstractmethod
    def fill(self, ids: Sequence[int], keys: Sequence[bytes], rng: random.Random) -> None:
        """Write fresh random bytes into the locations `ids`."""

    @abstractmethod
    def read(self, ids: Sequence[int], keys: Sequence[bytes]) -> list[bytes]:
        """The bytes held by each location of `ids`."""

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()


def _random_bytes(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(8 * n).to_bytes(n, "little")


class _BackendSide(Side):
    """The slots of one backend, addressed by its own spec type."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.backends = {backend.name: backend}
        self.spec_type = backend.spec_type

    @property
    def num_locations(self) -> int:
        return self.backend.num_blocks

    def spec(self, ids, keys, block_indices=None):
        return self.spec_type.for_blocks(ids, keys, tier=self.backend.name)


class HostSlotSide(_BackendSide):
    """Slots of a host-memory backend (`view(slot) -> memoryview`)."""

    def fill(self, ids, keys, rng):
        for slot in ids:
            self.backend.view(slot)[:] = _random_bytes(rng, self.backend.block_bytes)

    def read(self, ids, keys):
        return [bytes(self.backend.view(slot)) for slot in ids]


class FileSlotSide(_BackendSide):
    """Slots of a file tier (`write_blocks` / `read_blocks`, keyed and verified)."""

    def fill(self, ids, keys, rng):
        self.backend.write_blocks(list(ids), list(keys), [_random_bytes(rng, self.backend.block_bytes) for _ in ids])

    def read(self, ids, keys):
        buffers = [bytearray(self.backend.block_bytes) for _ in ids]
        self.backend.read_blocks(list(ids), list(keys), buffers)
        return [bytes(b) for b in buffers]


class RemoteSlotSide(_BackendSide):
    """Handles of a shared remote tier (`put_blocks` / `get_blocks` by key, verified)."""

    def fill(self, ids, keys, rng):
        self.backend.put_blocks(list(keys), [_random_bytes(rng, self.backend.block_bytes) for _ in ids])

    def read(self, ids, keys):
        buffers = [bytearray(self.backend.block_bytes) for _ in ids]
        self.backend.get_blocks(list(keys), buffers)
        return [bytes(b) for b in buffers]


class EngineSide(Side):
    """The engine's KV cache as CPU tensors (`ChunkedKVCaches`, one KV group); `span` =
    `blocks_per_chunk`. A location's bytes are its pages in the group's references, in order."""

    spec_type = GPULoadStoreSpec

    def __init__(self, kv_caches: Any):
        self.kv_caches = kv_caches
        self.backends = {}
        self.span = int(getattr(kv_caches, "blocks_per_chunk", 1))
        refs = kv_caches.group_data_refs[0] if kv_caches.group_data_refs else None
        self.pages = ([(r.tensor_idx, r.page_size_bytes) for r in refs] if refs else
                      [(i, t.page_size_bytes) for i, t in enumerate(kv_caches.tensors)])

    @property
    def num_locations(self) -> int:
        return min(t.tensor.shape[0] for t in self.kv_caches.tensors)

    def spec(self, ids, keys, block_indices=None):
        groups = len(self.kv_caches.group_data_refs) or 1
        sizes = [len(ids)] + [0] * (groups - 1)
        indices = None if block_indices is None else list(block_indices) + [0] * (groups - 1)
        return GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=indices)

    def _page(self, tensor_idx: int, block: int, page: int):
        import torch

        return self.kv_caches.tensors[tensor_idx].tensor[block].view(torch.uint8)[:page]

    def fill(self, ids, keys, rng):
        import torch

        for block in ids:
            for t, page in self.pages:
                data = torch.frombuffer(bytearray(_random_bytes(rng, page)), dtype=torch.uint8)
                self._page(t, block, page).copy_(data)

    def read(self, ids, keys):
        return [b"".join(self._page(t, block, page).numpy().tobytes() for t, page in self.pages) for block in ids]

    def close(self) -> None:
        return


class JobCollector:
    """Binds handlers like the router does and counts every report (from any thread)."""

    def __init__(self, *handlers: TransferHandler):
        self.handlers = handlers
        self.results: dict[int, TransferResult] = {}
        self.reports: Counter[int] = Counter()
        self._lock = threading.Lock()
        for handler in handlers:
            handler.bind(self._done)

    def _done(self, result: TransferResult) -> None:
        with self._lock:
            self.reports[result.job_id] += 1
            self.results[result.job_id] = result

    def run(self, handler: TransferHandler, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferResult:
        """Submit one job, wait for it, return its result (asserting it was reported)."""
        handler.submit(job_id, src, dst)
        handler.wait([job_id])
        with self._lock:
            assert job_id in self.results, f"job {job_id}: wait() returned before the job was reported"
            return self.results[job_id]

    def close(self) -> None:
        for handler in self.handlers:
            handler.shutdown()


class HandlerTests:
    """Conformance suite for one handler pair; subclass it and implement `make_sides`.

    Test methods take pytest's `tmp_path`; they can also be called directly with any directory.
    """

    #: offloaded blocks per job in the round-trip tests
    blocks_per_job = 5
    seed = 1234

    # ------------------------------------------------------------------ hooks
    def make_sides(self, tmp_path) -> tuple[Side, Side]:
        """Build (source side, destination side) in fresh state; both are closed by the suite."""
        raise NotImplementedError

    def make_handler(self, src: Side, dst: Side) -> TransferHandler:
        """The handler for src -> dst; by default the registry's factory for the two spec types."""
        backends = {**src.backends, **dst.backends}
        kv_caches = src.kv_caches if src.kv_caches is not None else dst.kv_caches
        factory = registry.handler_factory(src.spec_type, dst.spec_type)
        if factory is None:
            raise LookupError(f"no handler registered for {src.spec_type.__name__} -> {dst.spec_type.__name__}")
        handler = factory(backends, kv_caches)
        assert handler is not None, \
            f"the registry made no handler for {src.spec_type.__name__} -> {dst.spec_type.__name__}"
        return handler

    def failing_job(self, src: Side, dst: Side, keys: Sequence[bytes]) -> tuple[LoadStoreSpec, LoadStoreSpec]:
        """A (source spec, destination spec) the forward handler cannot carry out. By default the
        destination names locations past its end; override to break the destination another way."""
        n = len(keys)
        bad = [dst.num_locations + 3 + i for i in range(n * dst.span)]
        return src.spec(list(range(n * src.span)), keys), dst.spec(bad, keys)

    # ------------------------------------------------------------------ helpers
    def _open(self, tmp_path):
        src, dst = self.make_sides(tmp_path)
        forward, backward = self.make_handler(src, dst), self.make_handler(dst, src)
        return src, dst, forward, backward, JobCollector(forward, backward)

    @staticmethod
    def _close(src: Side, dst: Side, jobs: JobCollector) -> None:
        jobs.close()
        src.close()
        dst.close()

    @staticmethod
    def _keys(n: int, start: int = 0) -> list[bytes]:
        return [make_offload_key((0x6B76 << 32 | i).to_bytes(8, "big"), 0) for i in range(start, start + n)]

    @staticmethod
    def _ids(side: Side, n: int, rng: random.Random, exclude: Sequence[int] = ()) -> list[int]:
        """`n` offloaded blocks' worth of distinct locations of `side`, in random order."""
        free = sorted(set(range(side.num_locations)) - set(exclude))
        assert len(free) >= n * side.span, "the side is too small for the suite; give it more locations"
        return rng.sample(free, n * side.span)

    @staticmethod
    def _engine_pair(src: Side, dst: Side, forward, backward):
        """(engine side, slot side, engine -> slot handler, slot -> engine handler), or None."""
        if issubclass(src.spec_type, GPULoadStoreSpec):
            return src, dst, forward, backward
        if issubclass(dst.spec_type, GPULoadStoreSpec):
            return dst, src, backward, forward
        return None

    # ------------------------------------------------------------------ tests
    def test_round_trip_is_byte_exact(self, tmp_path):
        src, dst, forward, backward, jobs = self._open(tmp_path)
        try:
            rng, n = random.Random(self.seed), self.blocks_per_job
            keys = self._keys(n)
            a = self._ids(src, n, rng)
            b = self._ids(dst, n, rng)
            src.fill(a, keys, rng)
            expected = src.read(a, keys)
            r = jobs.run(forward, 1, src.spec(a, keys), dst.spec(b, keys))
            assert r.success, f"store failed: {r.error}"
            back = self._ids(src, n, rng, exclude=a)
            src.fill(back, keys, rng)  # poison: a block the load skips keeps other bytes
            r = jobs.run(backward, 2, dst.spec(b, keys), src.spec(back, keys))
            assert r.success, f"load failed: {r.error}"
            got = src.read(back, keys)
            wrong = [i for i, (x, y) in enumerate(zip(got, expected)) if x != y]
            assert not wrong, \
                f"locations {[back[i] for i in wrong]} came back with other bytes than {[a[i] for i in wrong]}"
            assert src.read(a, keys) == expected, "the store changed its source"
        finally:
            self._close(src, dst, jobs)

    def test_partial_first_block_loads_only_covered_sub_blocks(self, tmp_path):
        src, dst, forward, backward, jobs = self._open(tmp_path)
        try:
            pair = self._engine_pair(src, dst, forward, backward)
            if pair is None or pair[0].span < 2:
                _skip("needs an engine side with more than one engine block per offloaded block")
            engine, slots, store, load = pair
            rng, n, bpc = random.Random(self.seed + 1), self.blocks_per_job, pair[0].span
            keys = self._keys(n)
            e = self._ids(engine, n, rng)
            s = self._ids(slots, n, rng)
            engine.fill(e, keys, rng)
            expected = engine.read(e, keys)
            assert jobs.run(store, 1, engine.spec(e, keys), slots.spec(s, keys)).success
            for job, (skip, tail) in enumerate(((1, 0), (bpc - 1, 1), (1, bpc - 1)), start=2):
                covered = n * bpc - skip - tail
                if covered <= 0:
                    continue
                f = self._ids(engine, n, rng, exclude=e)[:covered]
                engine.fill(f, keys, rng)
                used = -(-(covered + skip) // bpc)  # offloaded blocks the load touches
                r = jobs.run(load, job, slots.spec(s[:used], keys[:used]),
                             engine.spec(f, keys[:used], block_indices=[skip]))
                assert r.success, f"load with block_indices=[{skip}] failed: {r.error}"
                got = engine.read(f, keys)
                assert got == expected[skip:skip + covered], (
                    f"block_indices=[{skip}]: engine blocks do not hold sub-blocks {skip}..{skip + covered - 1}")
        finally:
            self._close(src, dst, jobs)

    def test_failed_job_reports_failure(self, tmp_path):
        src, dst, forward, backward, jobs = self._open(tmp_path)
        try:
            rng, keys = random.Random(self.seed + 2), self._keys(2)
            spec_src, spec_dst = self.failing_job(src, dst, keys)
            r = jobs.run(forward, 7, spec_src, spec_dst)  # must not raise
            assert r.success is False, "a job that could not be carried out reported success"
            assert jobs.reports[7] == 1
            # The handler still works after a failure.
            a, b = self._ids(src, 2, rng), self._ids(dst, 2, rng)
            src.fill(a, keys, rng)
            assert jobs.run(forward, 8, src.spec(a, keys), dst.spec(b, keys)).success
        finally:
            self._close(src, dst, jobs)

    def test_no_job_lost(self, tmp_path):
        src, dst, forward, backward, jobs = self._open(tmp_path)
        try:
            rng = random.Random(self.seed + 3)
            per_job, count = 2, 6
            keys = self._keys(per_job * count)
            a = self._ids(src, per_job * count, rng)
            b = self._ids(dst, per_job * count, rng)
            src.fill(a, keys, rng)
            expected_ok: dict[int, bool] = {}
            for j in range(count):
                k = keys[j * per_job:(j + 1) * per_job]
                sa = a[j * per_job * src.span:(j + 1) * per_job * src.span]
                sb = b[j * per_job * dst.span:(j + 1) * per_job * dst.span]
                job_id = 100 + j
                if j % 3 == 2:
                    forward.submit(job_id, *self.failing_job(src, dst, k))
                    expected_ok[job_id] = False
                else:
                    forward.submit(job_id, src.spec(sa, k), dst.spec(sb, k))
                    expected_ok[job_id] = True
            forward.wait(list(expected_ok))
            assert dict(jobs.reports) == {j: 1 for j in expected_ok}, f"reports per job: {dict(jobs.reports)}"
            assert {j: jobs.results[j].success for j in expected_ok} == expected_ok
        finally:
            self._close(src, dst, jobs)


def _skip(reason: str) -> None:
    import pytest  # only when a test is skipped: importing the suite does not need pytest

    pytest.skip(reason)
