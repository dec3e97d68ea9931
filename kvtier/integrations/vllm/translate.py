"""kvtier <-> vLLM types: the specs the scheduler side hands out and the worker side reads, media.

A load's source is a `KVTierCPULoadStoreSpec` (slots of the CPU tier), or, where file tiers are
loaded directly by the worker (`KVTierOffloadingSpec`, docs/vllm.md), a `KVTierFileLoadStoreSpec`
(slots of a file tier, with the keys their headers must carry and the identity of the tier's
manifest: the worker reads the tier itself, read-only, `file_loads`) or a `KVTierCompositeLoadStoreSpec`
(a request whose blocks are split between tiers: each part with the positions, in the load's key
order, of the blocks it addresses). All are plain data (picklable) and carry the token of the
scheduler's CPU region, which the worker checks before it maps the region.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, LoadStoreSpec, Medium
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VllmCPULoadStoreSpec

from kvtier.core import specs as kspecs
from kvtier.core.keys import OffloadKey
from kvtier.tiers.file.spec import FileLoadStoreSpec

_MEDIA = {"CPU": "CPU", "FILE": "STORAGE"}


def to_vllm_medium(medium: str) -> Medium:
    """kvtier medium name -> vLLM `Medium` ("CPU" -> CPU, "FILE" and anything else -> STORAGE)."""
    return Medium[_MEDIA.get(medium, "STORAGE")]


class KVTierCPULoadStoreSpec(VllmCPULoadStoreSpec):
    """Slots of a kvtier CPU tier (`tier` names it; `region` is the token of the shared region the
    scheduler created, which the worker checks before it maps the region). A vLLM
    `CPULoadStoreSpec`, so vLLM's own accounting treats it as a CPU transfer; plain data, picklable."""

    def __init__(self, block_ids, tier: str | None = None, region: str | None = None):
        super().__init__(list(block_ids))
        self.tier = tier
        self.region = region

    def __repr__(self) -> str:
        return f"KVTierCPULoadStoreSpec({list(map(int, self.block_ids))}, tier={self.tier!r})"


class KVTierHostLoadStoreSpec(KVTierCPULoadStoreSpec):
    """Slots of the host owner's CPU region (`shared: host`, `host_manager`): `region` is its
    token, `shm_name` and `num_blocks` name and size it, so that the worker maps exactly that
    region (a restarted owner has a new one; None when no owner answered). A load's `keys` are
    every key the engine loads, in its order; the owner pinned only the first `len(block_ids)`
    of them (another engine may have evicted the rest since the lookup): the worker loads those
    and fails the others, never reading a slot not pinned for it. A store's `keys` is empty.
    Plain data, picklable."""

    def __init__(self, block_ids, tier: str | None = None, region: str | None = None, shm_name: str | None = None,
                 num_blocks: int = 0, keys=()):
        super().__init__(block_ids, tier, region)
        self.shm_name = shm_name
        self.num_blocks = int(num_blocks)
        self.keys = [bytes(k) for k in keys]

    @property
    def pinned(self) -> int:
        """How many of a load's leading `keys` the owner pinned (their slots are `block_ids`)."""
        return len(self.block_ids)

    def __repr__(self) -> str:
        unpinned = f", unpinned={len(self.keys) - self.pinned}" if len(self.keys) > self.pinned else ""
        return f"KVTierHostLoadStoreSpec({list(map(int, self.block_ids))}, shm={self.shm_name!r}{unpinned})"


class KVTierFileLoadStoreSpec(LoadStoreSpec):
    """Slots of a kvtier file tier that the worker reads itself (`block_ids[i]` holds the block
    `keys[i]`); `identity`: the digest of the tier's manifest (epoch included) that the worker's
    reader must have opened; `region` as for `KVTierCPULoadStoreSpec`. No path: the worker finds
    the tier in its own config. Plain data, picklable."""

    def __init__(self, block_ids, keys, tier: str | None = None, region: str | None = None,
                 identity: bytes | None = None):
        self.block_ids = [int(i) for i in block_ids]
        self.keys = [bytes(k) for k in keys]
        self.tier = tier
        self.region = region
        self.identity = None if identity is None else bytes(identity)

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"KVTierFileLoadStoreSpec({self.block_ids}, tier={self.tier!r})"


class KVTierCompositeLoadStoreSpec(LoadStoreSpec):
    """A load from several tiers: `parts[i] = (spec, positions)`, `positions` being the indices,
    in the load's key order (the order of its engine blocks), of the blocks `spec` addresses.
    The worker succeeds only if every part does. Plain data, picklable."""

    def __init__(self, parts, region: str | None = None):
        self.parts = [(spec, [int(p) for p in positions]) for spec, positions in parts]
        self.region = region

    def __len__(self) -> int:
        return sum(len(positions) for _, positions in self.parts)

    def __repr__(self) -> str:
        return f"KVTierCompositeLoadStoreSpec({self.parts})"


def _to_vllm_spec(spec: kspecs.LoadStoreSpec, region: str | None,
                  identities: Mapping[str, bytes] | None = None) -> LoadStoreSpec:
    """The vLLM-side spec of a kvtier spec the manager handed out (`TypeError` for other kinds);
    `identities`: the manifest digest of each file tier, by name."""
    if isinstance(spec, kspecs.CPULoadStoreSpec):
        return KVTierCPULoadStoreSpec(spec.block_ids, spec.tier, region)
    if isinstance(spec, FileLoadStoreSpec):
        identity = (identities or {}).get(spec.tier or "")
        return KVTierFileLoadStoreSpec(spec.block_ids, spec.keys, spec.tier, region, identity)
    if isinstance(spec, kspecs.CompositeLoadStoreSpec):
        return KVTierCompositeLoadStoreSpec([(_to_vllm_spec(part, region, identities), positions)
                                             for part, positions in spec.parts], region)
    raise TypeError(f"kvtier returned a {type(spec).__name__} for the engine; only CPU-tier and file-tier specs "
                    f"are served to vLLM workers (other tiers are promoted into the CPU tier first)")


def file_identities(spec: LoadStoreSpec) -> dict[str, bytes]:
    """Worker side: the tier identity each file part of a load's source names, by tier."""
    parts = spec.parts if isinstance(spec, KVTierCompositeLoadStoreSpec) else [(spec, ())]
    return {str(part.tier): part.identity for part, _ in parts
            if isinstance(part, KVTierFileLoadStoreSpec) and part.identity is not None}


def to_kvtier_load_spec(spec: LoadStoreSpec, default_tier: str) -> kspecs.LoadStoreSpec:
    """Worker side: the kvtier spec of a load's source as `_to_vllm_spec` made it (a plain vLLM
    CPU spec names no tier: `default_tier`, the CPU tier). A composite becomes the staged load
    of `kvtier.transfer.handlers.gpu_file` (one staging buffer, one scatter; never split by the router)."""
    from kvtier.transfer.handlers.gpu_file import StagedLoadSpec

    if isinstance(spec, KVTierFileLoadStoreSpec):
        return FileLoadStoreSpec(spec.block_ids, [OffloadKey(k) for k in spec.keys], spec.tier)
    if isinstance(spec, KVTierCompositeLoadStoreSpec):
        return StagedLoadSpec([(to_kvtier_load_spec(part, default_tier), positions)
                               for part, positions in spec.parts])
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"a load from a {type(spec).__name__}: this worker loads CPU-tier and file-tier slots only")
    return to_kvtier_cpu_spec(spec, default_tier)


def to_kvtier_cpu_spec(spec: Any, default_tier: str) -> kspecs.CPULoadStoreSpec:
    """Worker side: the kvtier CPU-tier spec of vLLM CPU slots (a store's destination, a load's
    source); a plain vLLM CPU spec names no tier: `default_tier`, the CPU tier."""
    return kspecs.CPULoadStoreSpec(spec.block_ids, getattr(spec, "tier", None) or default_tier)
