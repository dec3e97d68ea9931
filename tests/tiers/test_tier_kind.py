"""A tier kind is one package: its backend, its spec type and the hops it brings
(`Backend.handlers`), entered into the handler table when the class is loaded. Named in YAML as
"package.module:Class" it needs nothing else; a short name is one line in `registry.BACKENDS`."""

from __future__ import annotations

import contextlib
import sys
import textwrap

import pytest
from conftest import keys

from kvtier import ConfigError, build_hierarchy, load_config_text
from kvtier.core.errors import KVTierError
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.transfer import registry

BLOCK = 64

# A new kind of local tier, written as a third party would: blocks kept as bytes in a dict.
KIND_PACKAGE = '''
"""Acme: a tier kind of its own (spec, backend, handlers), known to kvtier by nothing else."""

from kvtier.core.specs import BlockIDsLoadStoreSpec, CPULoadStoreSpec
from kvtier.tiers.base import Backend, HostSlots
from kvtier.transfer.handlers.base import SyncHandler, serving


class AcmeSpec(BlockIDsLoadStoreSpec):
    @staticmethod
    def medium():
        return "ACME"


class AcmeHandler(SyncHandler):
    def __init__(self, hosts, acmes, to_acme):
        super().__init__()
        self.hosts, self.acmes, self.to_acme = hosts, acmes, to_acme

    def copy(self, src, dst):
        host_spec, acme_spec = (src, dst) if self.to_acme else (dst, src)
        host, acme = self.hosts[host_spec.tier], self.acmes[acme_spec.tier]
        for h, a in zip(host_spec.block_ids, acme_spec.block_ids):
            if self.to_acme:
                acme.blobs[a] = bytes(host.view(h))
            else:
                host.view(h)[:] = acme.blobs[a]
        return len(src) * host.block_bytes


def _factory(to_acme):
    def factory(backends, kv_caches=None):
        acmes = {n: b for n, b in backends.items() if isinstance(b, AcmeBackend)}
        hosts = serving(backends, HostSlots)
        return AcmeHandler(hosts, acmes, to_acme) if acmes and hosts else None
    return factory


class AcmeBackend(Backend):
    spec_type = AcmeSpec
    medium = "ACME"
    handlers = ((CPULoadStoreSpec, AcmeSpec, _factory(True)), (AcmeSpec, CPULoadStoreSpec, _factory(False)))

    def __init__(self, name, num_blocks, block_bytes, block_size=0):
        super().__init__(name, num_blocks, block_bytes, block_size)
        self.blobs = {}


class MalformedBackend(AcmeBackend):
    handlers = ((CPULoadStoreSpec, "AcmeSpec", _factory(True)),)


class GreedyBackend(AcmeBackend):
    handlers = ((CPULoadStoreSpec, CPULoadStoreSpec, _factory(True)),)


class HalfGreedyBackend(AcmeBackend):
    handlers = ((AcmeSpec, CPULoadStoreSpec, _factory(False)), (CPULoadStoreSpec, CPULoadStoreSpec, _factory(True)))
'''


@pytest.fixture
def acme(tmp_path, monkeypatch):
    """The `acme_kind` package on sys.path; its hops are taken out of the handler table after."""
    (tmp_path / "acme_kind").mkdir()
    (tmp_path / "acme_kind" / "__init__.py").write_text(textwrap.dedent(KIND_PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    module = sys.modules.pop("acme_kind", None)
    if module is not None:
        for pair in [(CPULoadStoreSpec, module.AcmeSpec), (module.AcmeSpec, CPULoadStoreSpec)]:
            with contextlib.suppress(KVTierError):  # (not entered: the test refused the kind)
                registry.unregister_handler(*pair)


def _build(backend: str):
    return build_hierarchy(load_config_text(f"""
block_bytes: {BLOCK}B
tiers:
  - {{name: hot, backend: memory, capacity: 4 blocks, policy: lru, cascade: on_evict, reserve: 0.25}}
  - {{name: warm, backend: "{backend}", capacity: 16 blocks, policy: lru}}
"""))


def _cascade_and_read_back(h) -> None:
    """12 blocks through a 4-block first tier (8 cascade into the new kind), each read back byte-identical."""
    m, hot = h.manager, h.backends["hot"]
    ks = keys(12)
    for i in range(0, 12, 2):
        out = m.prepare_store(ks[i:i + 2])
        assert out is not None
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            hot.view(slot)[:] = (key * 8)[:BLOCK]
        m.complete_store(out.keys_to_store)
        m.on_schedule_end()
    assert len(h.backends["warm"].blobs) >= 8
    for key in ks:
        for _ in range(5):
            if m.lookup(key).name == "HIT":
                break
            m.on_schedule_end()
        spec = m.prepare_load([key])
        assert bytes(h.backends[spec.tier].view(spec.block_ids[0])) == (key * 8)[:BLOCK]
        m.complete_load([key])


def test_a_kind_named_by_its_module_path_brings_its_own_hops(acme):
    with _build("acme_kind:AcmeBackend") as h:
        _cascade_and_read_back(h)
        assert h.manager.get_stats()["warm"]["promotions"] >= 8
    assert registry.has_handler(CPULoadStoreSpec, "AcmeSpec") and registry.has_handler("AcmeSpec", "CPULoadStoreSpec")


def test_a_short_name_for_a_kind_is_one_line_in_the_registry(acme, monkeypatch):
    monkeypatch.setitem(registry.BACKENDS, "acme", "acme_kind:AcmeBackend")
    with _build("acme") as h:
        _cascade_and_read_back(h)


def test_a_malformed_hop_declaration_is_refused_naming_the_field(acme):
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.backend.*MalformedBackend\.handlers\[0\].*destination spec"):
        _build("acme_kind:MalformedBackend")


def test_a_kind_cannot_take_over_a_pair_another_factory_serves(acme):
    with pytest.raises(ConfigError, match=r"CPULoadStoreSpec -> CPULoadStoreSpec is already served by "
                                          r"kvtier\.transfer\.handlers\.memory:MemoryCopyHandler\.for_backends"):
        _build("acme_kind:GreedyBackend")
    assert registry.handler_factory(CPULoadStoreSpec, CPULoadStoreSpec).__qualname__ == "MemoryCopyHandler.for_backends"


def test_a_refused_kind_leaves_none_of_its_hops_in_the_table(acme):
    with pytest.raises(ConfigError, match=r"HalfGreedyBackend\.handlers\[1\].*already served by"):
        _build("acme_kind:HalfGreedyBackend")
    assert registry.handler_factory(sys.modules["acme_kind"].AcmeSpec, CPULoadStoreSpec) is None
