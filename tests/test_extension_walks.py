"""A new built-in tier kind or policy, added as the README says (a package or a file, one registry
line, its conformance classes), passes the repository's rule tests with no other test edit; and
those tests still fail, naming it, while it has no conformance class.

The rule tests are run here as they are, on a throwaway registry entry (a tiny backend and a tiny
policy defined in this file), from copies of their modules loaded for this purpose.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvtier.core.specs import BlockIDsLoadStoreSpec, CPULoadStoreSpec
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.testing import BackendTests, HostSlotSide, PolicyTests, Side
from kvtier.tiers.base import Backend
from kvtier.tiers.memory import MemoryBackend
from kvtier.transfer import registry

TESTS = Path(__file__).resolve().parent


def _load(rel: str, monkeypatch: pytest.MonkeyPatch, *path: str) -> ModuleType:
    """A fresh copy of the test module `tests/<rel>` (its own globals, so classes added to it here
    stay here), with `path` (under tests/) on sys.path while it imports."""
    for extra in path:
        monkeypatch.syspath_prepend(str(TESTS / extra))
    name = "_walked_" + rel.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, TESTS / rel)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- a tier kind: kvtier.tiers.dict, say
class DictSpec(BlockIDsLoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "DICT"


def to_dict(backends, kv_caches=None):  # the hops' factories (never called here)
    return None


def from_dict(backends, kv_caches=None):
    return None


class DictBackend(Backend):
    """Blocks kept as bytes in a dict; no `view`, no `write_blocks`: its suite says how bytes move."""

    spec_type = DictSpec
    medium = "DICT"
    persistent = False
    handlers = ((CPULoadStoreSpec, DictSpec, f"{__name__}:to_dict"),
                (DictSpec, CPULoadStoreSpec, f"{__name__}:from_dict"))

    def __init__(self, name, num_blocks, block_bytes, block_size=0):
        super().__init__(name, num_blocks, block_bytes, block_size)
        self.blobs: dict[int, bytes] = {}

    def close(self) -> None:
        self.blobs.clear()


class DictBackendSuite(BackendTests):
    """The kind's conformance class, as the README's how-to writes it (named Test... where it lives)."""

    def make_backend(self, num_blocks, block_bytes):
        return DictBackend("d", num_blocks, block_bytes)

    def write_bytes(self, backend, keys, blocks, data):
        for block, chunk in zip(blocks, data):
            backend.blobs[block.block_id] = bytes(chunk)

    def read_bytes(self, backend, keys, blocks):
        return [backend.blobs[block.block_id] for block in blocks]


class DictSide(Side):
    def __init__(self, backend: DictBackend):
        self.backend = backend
        self.backends = {backend.name: backend}
        self.spec_type = backend.spec_type

    @property
    def num_locations(self) -> int:
        return self.backend.num_blocks

    def spec(self, ids, keys, block_indices=None):
        return self.spec_type.for_blocks(ids, keys, tier=self.backend.name)

    def fill(self, ids, keys, rng):
        for i in ids:
            self.backend.blobs[i] = rng.randbytes(self.backend.block_bytes)

    def read(self, ids, keys):
        return [self.backend.blobs[i] for i in ids]


def _kind_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one registry line (`BACKENDS`), for this test only; the handler table is not touched."""
    monkeypatch.setitem(registry.BACKENDS, "dict", f"{__name__}:DictBackend")


def test_a_tier_kind_package_may_build_on_the_handler_contract(monkeypatch, tmp_path):
    """tests/test_imports.py's layering rule lets any package `kvtier.tiers.<kind>` import the handler
    contract, and nothing else of `transfer`, nor a module of `tiers` outside a kind's package."""
    rules = _load("test_imports.py", monkeypatch)
    package = tmp_path / "kvtier"
    for name in rules.PACKAGE_ORDER:
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    kind = package / "tiers" / "dict"
    kind.mkdir()
    (kind / "__init__.py").write_text("from kvtier.transfer.handlers.base import SyncHandler\n")
    (kind / "handler.py").write_text("import kvtier.transfer.handlers.base\n")
    (kind / "bad.py").write_text("from kvtier.transfer.router import TransferRouter\n")
    (package / "tiers" / "base.py").write_text("from kvtier.transfer.handlers.base import TransferHandler\n")
    assert rules.upward_imports(package) == ["kvtier.tiers.base imports kvtier.transfer.handlers.base",
                                             "kvtier.tiers.dict.bad imports kvtier.transfer.router"]


def test_a_new_backend_kind_needs_its_suite_and_nothing_else(monkeypatch):
    conformance = _load("tiers/test_backend_conformance.py", monkeypatch)
    _kind_registered(monkeypatch)
    with pytest.raises(AssertionError, match=r"\['dict'\]"):
        conformance.test_every_registered_backend_runs_the_suite()
    monkeypatch.setattr(conformance, "TestDictBackend", DictBackendSuite, raising=False)
    conformance.test_every_registered_backend_runs_the_suite()


def test_the_new_kind_passes_its_suite_with_write_bytes_and_read_bytes():
    """What the README's BackendTests how-to says a backend without `view` or `write_blocks` needs."""
    ran = 0
    for name in sorted(n for n in dir(DictBackendSuite) if n.startswith("test_")):
        suite = DictBackendSuite()
        try:
            getattr(suite, name)()
            ran += 1
        except pytest.skip.Exception:
            pass
        finally:
            suite.teardown_method()
    assert ran > 10


def test_a_new_backend_kind_needs_suites_for_its_hops(monkeypatch, tmp_path):
    pytest.importorskip("torch")  # (the handler conformance module needs it to import)
    conformance = _load("handlers/test_handler_conformance.py", monkeypatch)
    _kind_registered(monkeypatch)

    class CPUToDict(conformance.HandlerTests):
        def make_sides(self, tmp_path):
            return HostSlotSide(MemoryBackend("a", 16, 256)), DictSide(DictBackend("d", 16, 256))

    class DictToCPU(conformance.HandlerTests):
        def make_sides(self, tmp_path):
            return DictSide(DictBackend("d", 16, 256)), HostSlotSide(MemoryBackend("a", 16, 256))

    (tmp_path / "without").mkdir()
    with pytest.raises(AssertionError, match=r"\['CPULoadStoreSpec -> DictSpec', 'DictSpec -> CPULoadStoreSpec'\]"):
        conformance.test_every_registered_pair_runs_the_suite(tmp_path / "without")
    monkeypatch.setattr(conformance, "TestCPUToDict", CPUToDict, raising=False)
    (tmp_path / "one").mkdir()
    with pytest.raises(AssertionError, match=r"\['DictSpec -> CPULoadStoreSpec'\]"):
        conformance.test_every_registered_pair_runs_the_suite(tmp_path / "one")
    monkeypatch.setattr(conformance, "TestDictToCPU", DictToCPU, raising=False)
    (tmp_path / "both").mkdir()
    conformance.test_every_registered_pair_runs_the_suite(tmp_path / "both")


def test_a_kind_no_hop_serves_is_named(monkeypatch, tmp_path):
    """A registered kind whose spec type no declared pair serves could never move a block."""
    pytest.importorskip("torch")
    conformance = _load("handlers/test_handler_conformance.py", monkeypatch)

    class Stranded(DictBackend):
        spec_type = type("StrandedSpec", (BlockIDsLoadStoreSpec,), {"medium": staticmethod(lambda: "STRANDED")})
        handlers = ()

    monkeypatch.setattr(sys.modules[__name__], "Stranded", Stranded, raising=False)
    monkeypatch.setitem(registry.BACKENDS, "stranded", f"{__name__}:Stranded")
    assert conformance.kinds_without_a_hop(registry.BACKENDS, conformance.registered_pairs(registry.BACKENDS)) \
        == ["stranded"]


# ---------------------------------------------------------------- a policy: kvtier/policies/fifo.py, say
class FifoPolicy(PureLRUCachePolicy):
    """Stands for a new built-in policy (a class of its own is all the registry check needs)."""


class FifoSuite(PolicyTests):
    policy_factory = FifoPolicy


def test_a_new_policy_needs_its_suite_and_nothing_else(monkeypatch):
    conformance = _load("policies/test_conformance.py", monkeypatch, "policies")
    monkeypatch.setitem(registry.POLICIES, "fifo", f"{__name__}:FifoPolicy")
    with pytest.raises(AssertionError, match=r"\['fifo'\]"):
        conformance.test_every_registered_policy_runs_the_suite()
    monkeypatch.setattr(conformance, "TestFifo", FifoSuite, raising=False)
    conformance.test_every_registered_policy_runs_the_suite()


def test_a_suite_through_make_policy_counts_too(monkeypatch):
    """A conformance class may override `make_policy` instead of setting `policy_factory`."""
    conformance = _load("policies/test_conformance.py", monkeypatch, "policies")

    class Made(PolicyTests):
        def make_policy(self, capacity):
            return FifoPolicy(capacity)

    monkeypatch.setitem(registry.POLICIES, "fifo", f"{__name__}:FifoPolicy")
    assert conformance.policies_without_a_suite(registry.POLICIES, [Made]) == sorted(
        name for name in registry.POLICIES if name != "fifo")
