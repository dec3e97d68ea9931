"""In-memory handler: copies blocks between `MemoryBackend` arenas (any spec types that name them)."""

from __future__ import annotations

from kvtier.core.specs import BlockIDsLoadStoreSpec, LoadStoreSpec
from kvtier.tiers.base import HostSlots
from kvtier.transfer.handlers.base import SyncHandler, serving


class MemoryCopyHandler(SyncHandler):
    """Copies slot to slot between host-memory backends (`HostSlots`); `spec.tier` selects the backend."""

    def __init__(self, backends: dict):
        super().__init__()
        self.backends = backends

    @classmethod
    def for_backends(cls, backends, kv_caches=None) -> MemoryCopyHandler | None:
        """Registry factory: serves every `HostSlots` backend; None when there is none."""
        usable = serving(backends, HostSlots)
        return cls(usable) if usable else None

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        assert isinstance(src, BlockIDsLoadStoreSpec) and isinstance(dst, BlockIDsLoadStoreSpec), "the registered pair"
        if len(src) != len(dst):
            raise ValueError(f"source has {len(src)} blocks, destination {len(dst)}")
        s, d = self.backends[src.tier], self.backends[dst.tier]
        if s.block_bytes != d.block_bytes:
            raise ValueError(f"block size differs: {s.name}={s.block_bytes} B, {d.name}={d.block_bytes} B")
        for a, b in zip(src.block_ids, dst.block_ids):
            d.view(b)[:] = s.view(a)
        return len(src) * s.block_bytes
