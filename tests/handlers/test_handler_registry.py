"""One handler table, matched by spec type through the MRO, for config checks and the router alike."""

from __future__ import annotations

import pytest
from conftest import keys

from kvtier import build_hierarchy, load_config_text
from kvtier.core.errors import KVTierError
from kvtier.core.specs import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.tiers.base import Backend, HostSlots
from kvtier.tiers.file.spec import FileLoadStoreSpec
from kvtier.tiers.memory import MemoryBackend
from kvtier.transfer import registry
from kvtier.transfer.handlers.base import SyncHandler, serving
from kvtier.transfer.handlers.memory import MemoryCopyHandler

BLOCK = 64


class HotSpec(CPULoadStoreSpec):
    """A third party's own spec type for a host-memory tier (a subclass of the built-in one)."""


class HotBackend(MemoryBackend):
    """A `module:Class` backend that hands out `HotSpec`s."""

    spec_type = HotSpec


class BlobSpec(BlockIDsLoadStoreSpec):
    """A spec type unrelated to any built-in one: slots of a `BlobBackend`."""

    @staticmethod
    def medium() -> str:
        return "BLOB"


class BlobBackend(Backend):
    """Blocks kept as `bytes` in a dict; offers no built-in capability, so only a registered
    handler can move its blocks."""

    spec_type = BlobSpec
    medium = "BLOB"

    def __init__(self, name: str, num_blocks: int, block_bytes: int, block_size: int = 0):
        super().__init__(name, num_blocks, block_bytes, block_size)
        self.blobs: dict[int, bytes] = {}


class BlobHandler(SyncHandler):
    """Host slots <-> blobs; counts the jobs it ran."""

    def __init__(self, hosts: dict, blobs: dict, to_blob: bool):
        super().__init__()
        self.hosts, self.blobs, self.to_blob, self.jobs = hosts, blobs, to_blob, 0

    def copy(self, src, dst):
        host_spec, blob_spec = (src, dst) if self.to_blob else (dst, src)
        host, blob = self.hosts[host_spec.tier], self.blobs[blob_spec.tier]
        for h, b in zip(host_spec.block_ids, blob_spec.block_ids):
            if self.to_blob:
                blob.blobs[b] = bytes(host.view(h))
            else:
                host.view(h)[:] = blob.blobs[b]
        self.jobs += 1
        return len(src) * host.block_bytes


made: list[BlobHandler] = []


def _blob_factory(to_blob: bool):
    def factory(backends, kv_caches=None):
        blobs = {n: b for n, b in backends.items() if isinstance(b, BlobBackend)}
        hosts = serving(backends, HostSlots)
        if not blobs or not hosts:
            return None
        made.append(BlobHandler(hosts, blobs, to_blob))
        return made[-1]
    return factory


@pytest.fixture
def blob_handlers():
    """(CPULoadStoreSpec <-> BlobSpec) registered for the test, removed after it."""
    registry.register_handler(CPULoadStoreSpec, BlobSpec, _blob_factory(to_blob=True))
    registry.register_handler(BlobSpec, CPULoadStoreSpec, _blob_factory(to_blob=False))
    made.clear()
    yield made
    registry.unregister_handler(CPULoadStoreSpec, BlobSpec)
    registry.unregister_handler(BlobSpec, CPULoadStoreSpec)


def _hierarchy(hot_backend: str, warm_backend: str):
    text = f"""
block_bytes: {BLOCK}B
tiers:
  - {{name: hot, backend: "{hot_backend}", capacity: 4 blocks, policy: lru, cascade: on_evict, reserve: 0.25}}
  - {{name: warm, backend: "{warm_backend}", capacity: 16 blocks, policy: lru}}
"""
    return build_hierarchy(load_config_text(text))


def _cascade_and_read_back(h, ctx) -> None:
    """Store 12 blocks into a 4-block top tier (8 cascade down), then read every one back."""
    m, hot = h.manager, h.backends["hot"]
    ks = keys(12)
    for i in range(0, 12, 2):
        out = m.prepare_store(ks[i:i + 2], ctx)
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            hot.view(slot)[:] = (key * 8)[:BLOCK]
        m.complete_store(out.keys_to_store, ctx)
        m.on_schedule_end()
    assert m.get_stats()["hot"]["cascade_dropped"] == 0
    for key in ks:
        for _ in range(5):
            if m.lookup(key, ctx).name == "HIT":
                break
            m.on_schedule_end()
        spec = m.prepare_load([key], ctx)
        assert bytes(h.backends[spec.tier].view(spec.block_ids[0])) == (key * 8)[:BLOCK]
        m.complete_load([key], ctx)


def test_a_module_class_backend_with_its_own_spec_subclass_gets_the_handler_of_its_base(ctx):
    """HotSpec has no entry of its own: (CPULoadStoreSpec, CPULoadStoreSpec) serves it through the MRO,
    in the config check and in the router."""
    assert registry.has_handler(HotSpec, CPULoadStoreSpec) and registry.has_handler("HotSpec", "CPULoadStoreSpec")
    with _hierarchy(f"{__name__}:HotBackend", "memory") as h:
        assert isinstance(h.router.handler_for(HotSpec, CPULoadStoreSpec), MemoryCopyHandler)
        _cascade_and_read_back(h, ctx)
        assert h.manager.get_stats()["warm"]["promotions"] >= 8


def test_a_registered_custom_spec_type_is_used_end_to_end(blob_handlers, ctx):
    assert registry.has_handler(CPULoadStoreSpec, BlobSpec) and registry.has_handler("BlobSpec", "CPULoadStoreSpec")
    with _hierarchy("memory", f"{__name__}:BlobBackend") as h:
        _cascade_and_read_back(h, ctx)
        to_blob, from_blob = blob_handlers
        assert to_blob.to_blob and to_blob.jobs >= 4 and from_blob.jobs >= 8
        assert len(h.backends["warm"].blobs) >= 8


def test_without_a_registered_handler_a_custom_tier_is_refused_by_the_config_check():
    with pytest.raises(KVTierError, match="no handler moves blocks from"):
        _hierarchy("memory", f"{__name__}:BlobBackend")


def test_registering_a_pair_twice_is_an_error_and_keeps_the_first(blob_handlers):
    first = registry.handler_factory(CPULoadStoreSpec, BlobSpec)
    with pytest.raises(KVTierError, match="already registered"):
        registry.register_handler(CPULoadStoreSpec, BlobSpec, _blob_factory(to_blob=True))
    assert registry.handler_factory(CPULoadStoreSpec, BlobSpec) is first
    with pytest.raises(KVTierError, match="CPULoadStoreSpec -> CPULoadStoreSpec is already registered"):
        registry.register_handler(CPULoadStoreSpec, CPULoadStoreSpec, _blob_factory(to_blob=True))
    assert registry.handler_factory(CPULoadStoreSpec, CPULoadStoreSpec) == MemoryCopyHandler.for_backends


def test_the_most_specific_registered_pair_wins_and_others_are_untouched():
    def factory(backends, kv_caches=None):
        return None

    registry.register_handler(HotSpec, CPULoadStoreSpec, factory)
    try:
        assert registry.handler_factory(HotSpec, CPULoadStoreSpec) is factory
        assert registry.handler_factory(HotSpec, HotSpec) is factory  # the source's MRO is walked first
        assert registry.handler_factory(CPULoadStoreSpec, HotSpec) == MemoryCopyHandler.for_backends
        assert registry.handler_factory(CPULoadStoreSpec, CPULoadStoreSpec) == MemoryCopyHandler.for_backends
        pairs = registry.handler_pairs([HotSpec, CPULoadStoreSpec])
        assert (HotSpec, CPULoadStoreSpec) in pairs and (CPULoadStoreSpec, CPULoadStoreSpec) in pairs
        assert all(FileLoadStoreSpec not in pair and GPULoadStoreSpec not in pair for pair in pairs)
    finally:
        registry.unregister_handler(HotSpec, CPULoadStoreSpec)
    assert registry.handler_factory(HotSpec, CPULoadStoreSpec) == MemoryCopyHandler.for_backends


def test_registration_arguments_are_checked():
    with pytest.raises(KVTierError, match="src_spec must be a LoadStoreSpec subclass"):
        registry.register_handler("CPULoadStoreSpec", BlobSpec, _blob_factory(True))
    with pytest.raises(KVTierError, match="factory must be a callable"):
        registry.register_handler(BlobSpec, BlobSpec, 42)
    with pytest.raises(KVTierError, match="no handler is registered for BlobSpec -> BlobSpec"):
        registry.unregister_handler(BlobSpec, BlobSpec)
    assert not registry.has_handler(BlobSpec, BlobSpec) and not registry.has_handler("NoSuchSpec", "CPULoadStoreSpec")
