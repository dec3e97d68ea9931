"""kvtier <-> vLLM types: the CPU spec the scheduler side hands out and the worker side reads, media."""

from __future__ import annotations

from vllm.v1.kv_offload.base import Medium
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VllmCPULoadStoreSpec

from kvtier import specs as kspecs

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


def _to_vllm_spec(spec: kspecs.LoadStoreSpec, region: str | None) -> KVTierCPULoadStoreSpec:
    if isinstance(spec, kspecs.CPULoadStoreSpec):
        return KVTierCPULoadStoreSpec(spec.block_ids, spec.tier, region)
    raise TypeError(f"kvtier returned a {type(spec).__name__} for the engine; only CPU-tier specs are served "
                    f"to vLLM workers (lower tiers are promoted into the CPU tier first)")
