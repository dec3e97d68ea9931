"""Every registered handler pair runs `kvtier.testing.handler.HandlerTests`, and a broken handler fails it.

The pairs are the hops the backends of `kvtier.transfer.registry.BACKENDS` declare
(`Backend.handlers`): a tier kind added to the registry needs `Test...(HandlerTests)` classes here
for its hops, and the coverage test below fails naming a pair no class here runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.fake_remote import FakeServer, fake_valkey
from kvtier.testing.handler import EngineSide, FileSlotSide, HandlerTests, HostSlotSide, RemoteSlotSide
from kvtier.tiers.cpu import CPUBackend
from kvtier.tiers.file import FileBackend, fileio
from kvtier.tiers.memory import MemoryBackend
from kvtier.transfer import registry
from kvtier.transfer.handlers.memory import MemoryCopyHandler

torch = pytest.importorskip("torch")

SLOTS = 24
BPC = 2  # engine blocks per offloaded block: exercises partial first blocks


def engine_side(num_blocks: int = 64) -> EngineSide:
    """Two KV tensors, one with rows wider than its page (stride(0) > page), one group over both."""
    from kvtier import CanonicalKVCacheRef, CanonicalKVCacheTensor
    from kvtier.transfer.handlers.gpu_cpu import ChunkedKVCaches

    t0 = torch.zeros((num_blocks, 512 + 64), dtype=torch.int8)
    t1 = torch.zeros((num_blocks, 256), dtype=torch.int8)
    kv = ChunkedKVCaches([CanonicalKVCacheTensor(t0, 512), CanonicalKVCacheTensor(t1, 256)],
                         [[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 256)]], BPC)
    return EngineSide(kv)


ENGINE_BLOCK_BYTES = BPC * (512 + 256)


def memory_side(name="mem", block_bytes=ENGINE_BLOCK_BYTES):
    return HostSlotSide(MemoryBackend(name, SLOTS, block_bytes))


def cpu_side(name="cpu", block_bytes=ENGINE_BLOCK_BYTES):
    return HostSlotSide(CPUBackend(name, SLOTS, block_bytes, pin="false"))


def file_side(tmp_path, io="posix", block_bytes=ENGINE_BLOCK_BYTES):
    if io == "kvikio":
        if not fileio.kvikio_importable():
            pytest.skip("kvikio not installed")
        from tests.support.fake_cuda import load_fake_libcuda

        load_fake_libcuda()
    return FileSlotSide(FileBackend("nvme", SLOTS, block_bytes, root_dir=str(tmp_path / f"nvme-{io}"), io=io,
                                    fingerprint="conformance", num_threads=2))


class TestMemoryToMemory(HandlerTests):
    def make_sides(self, tmp_path):
        return memory_side("a"), memory_side("b")


class TestMemoryToSharedCPU(HandlerTests):
    def make_sides(self, tmp_path):
        return memory_side(), cpu_side()


class TestSharedCPUToMemory(HandlerTests):
    def make_sides(self, tmp_path):
        return cpu_side(), memory_side()


class TestCPUToFile(HandlerTests):
    def make_sides(self, tmp_path):
        return cpu_side(), file_side(tmp_path)


class UnverifiedRead:
    """Failure hook for loads out of a file tier: ask for keys no slot was ever written with
    (the read must fail verification, not hand over whatever the slots hold)."""

    def failing_job(self, src, dst, keys):
        n = len(keys)
        foreign = [bytes(b ^ 0xFF for b in key) for key in keys]
        return src.spec(list(range(SLOTS - n, SLOTS)), foreign), dst.spec(list(range(n * dst.span)), keys)


class TestFileToCPU(UnverifiedRead, HandlerTests):
    def make_sides(self, tmp_path):
        return file_side(tmp_path), memory_side()


class TestCPUToFileKvikio(HandlerTests):
    def make_sides(self, tmp_path):
        return memory_side(), file_side(tmp_path, io="kvikio")


def remote_side(block_bytes=ENGINE_BLOCK_BYTES):
    """A valkey tier on a fake server (`kvtier.testing.fake_remote`)."""
    return RemoteSlotSide(fake_valkey(FakeServer(), "shared", SLOTS, block_bytes, threads=2))


class TestCPUToRemote(HandlerTests):
    def make_sides(self, tmp_path):
        return cpu_side(), remote_side()


class MissingRemoteValue:
    """Failure hook for loads out of a remote tier: keys never published (BlockMissing), not
    whatever bytes the destination held."""

    def failing_job(self, src, dst, keys):
        n = len(keys)
        foreign = [bytes(b ^ 0xFF for b in key) for key in keys]
        return src.spec(list(range(n)), foreign), dst.spec(list(range(n * dst.span)), keys)


class TestRemoteToCPU(MissingRemoteValue, HandlerTests):
    def make_sides(self, tmp_path):
        return remote_side(), memory_side()


class TestGPUToCPU(HandlerTests):
    def make_sides(self, tmp_path):
        return engine_side(), cpu_side()


class TestCPUToGPU(HandlerTests):
    def make_sides(self, tmp_path):
        return memory_side(), engine_side()


class TestGPUToFile(HandlerTests):
    def make_sides(self, tmp_path):
        return engine_side(), file_side(tmp_path)


class TestFileToGPU(UnverifiedRead, HandlerTests):
    def make_sides(self, tmp_path):
        return file_side(tmp_path), engine_side()


class TestGPUToFileKvikio(HandlerTests):
    def make_sides(self, tmp_path):
        return engine_side(), file_side(tmp_path, io="kvikio")


class DirectFileHandlers:
    """The direct (kvikio) engine <-> file handler, forced on CPU tensors: kvikio's host path."""

    def make_handler(self, src, dst):
        from kvtier.transfer.handlers.gpu_file_direct import DirectGPUFileHandler
        from kvtier.transfer.handlers.kv_layout import KVLayout, blocks_per_chunk_of

        engine = src if src.kv_caches is not None else dst
        layout = KVLayout(engine.kv_caches, blocks_per_chunk_of(engine.kv_caches))
        return DirectGPUFileHandler({**src.backends, **dst.backends}, layout, to_file=engine is src)


class TestGPUToFileDirect(DirectFileHandlers, HandlerTests):
    def make_sides(self, tmp_path):
        return engine_side(), file_side(tmp_path, io="kvikio")


class TestFileToGPUDirect(DirectFileHandlers, UnverifiedRead, HandlerTests):
    def make_sides(self, tmp_path):
        return file_side(tmp_path, io="kvikio"), engine_side()


def handler_suites(namespace: Mapping[str, Any]) -> dict[str, type]:
    """The conformance classes of a test module (its globals): `Test...` subclasses of HandlerTests."""
    return {name: obj for name, obj in namespace.items()
            if name.startswith("Test") and isinstance(obj, type) and issubclass(obj, HandlerTests)}


def registered_pairs(registered: Mapping[str, str]) -> set[tuple[type, type]]:
    """The (source spec type, destination spec type) pairs the backends of `registered` (name ->
    "module:Class", as `registry.BACKENDS`) declare."""
    return {(src, dst) for path in registered.values() for src, dst, _ in registry.load_object(path).handlers}


def kinds_without_a_hop(registered: Mapping[str, str], pairs: set[tuple[type, type]]) -> list[str]:
    """The kinds of `registered` whose spec type no pair serves, either way (nothing could move its blocks)."""
    served = {spec for pair in pairs for spec in pair}
    return sorted(name for name, path in registered.items()
                  if not served.intersection(registry.load_object(path).spec_type.__mro__))


def pairs_run(suites: Mapping[str, type], tmp_path: Path) -> list[tuple[type, type]]:
    """The (source, destination) spec types of each suite's sides; a suite that skips here (e.g.
    kvikio not installed) runs nothing."""
    run = []
    for name, cls in suites.items():
        (tmp_path / name).mkdir()
        try:
            src, dst = cls().make_sides(tmp_path / name)
        except pytest.skip.Exception:
            continue
        run.append((src.spec_type, dst.spec_type))
        src.close()
        dst.close()
    return run


def pairs_without_a_suite(pairs: set[tuple[type, type]], run: Iterable[tuple[type, type]]) -> list[str]:
    """The pairs of `pairs` that serve none of the jobs `run` (source, destination spec types), under
    the registry's matching rule (the first pair of `registry.spec_pairs` registered), as "Src -> Dst"."""
    served = {next((p for p in registry.spec_pairs(src, dst) if p in pairs), None) for src, dst in run}
    return sorted(f"{src.__name__} -> {dst.__name__}" for src, dst in pairs - served)


def test_every_registered_pair_runs_the_suite(tmp_path):
    """Every hop the registered backends declare, whatever they are, has a HandlerTests class here."""
    pairs = registered_pairs(registry.BACKENDS)
    assert kinds_without_a_hop(registry.BACKENDS, pairs) == []
    missing = pairs_without_a_suite(pairs, pairs_run(handler_suites(globals()), tmp_path))
    assert missing == [], (f"registered handler pairs no HandlerTests class in {__name__} runs: {missing}; "
                           "add a `class Test...(HandlerTests)` here whose make_sides has those spec types")


# ---------------------------------------------------------------------- the suite catches broken handlers
class DroppingCopy(MemoryCopyHandler):
    """Reports success but never copies the last block of a job."""

    def copy(self, src, dst):
        moved = super().copy(src.subset(range(len(src) - 1)), dst.subset(range(len(dst) - 1)))
        return moved + self.backends[src.tier].block_bytes


class DoubleReport(MemoryCopyHandler):
    """Reports every job twice."""

    def submit(self, job_id, src, dst):
        super().submit(job_id, src, dst)
        super().submit(job_id, src, dst)


class LosesAJob(MemoryCopyHandler):
    """Never reports its third job."""

    def submit(self, job_id, src, dst):
        self.submitted = getattr(self, "submitted", 0) + 1
        if self.submitted != 3:
            super().submit(job_id, src, dst)


class SwallowsFailures(MemoryCopyHandler):
    """Turns a failing copy into a success."""

    def copy(self, src, dst):
        try:
            return super().copy(src, dst)
        except Exception:  # noqa: BLE001 - the defect under test
            return 0


def broken_suite(handler_cls):
    class Broken(TestMemoryToMemory):
        def make_handler(self, src, dst):
            return handler_cls({**src.backends, **dst.backends})
    return Broken()


def test_a_handler_that_drops_a_block_fails_the_round_trip(tmp_path):
    with pytest.raises(AssertionError, match="other bytes"):
        broken_suite(DroppingCopy).test_round_trip_is_byte_exact(tmp_path)


def test_a_handler_that_reports_a_job_twice_fails_no_job_lost(tmp_path):
    with pytest.raises(AssertionError, match="reports per job"):
        broken_suite(DoubleReport).test_no_job_lost(tmp_path)


def test_a_handler_that_loses_a_job_fails_no_job_lost(tmp_path):
    with pytest.raises(AssertionError, match="reports per job"):
        broken_suite(LosesAJob).test_no_job_lost(tmp_path)


def test_a_handler_that_hides_a_failure_fails_the_failure_test(tmp_path):
    with pytest.raises(AssertionError, match="reported success"):
        broken_suite(SwallowsFailures).test_failed_job_reports_failure(tmp_path)
