"""The CPU tier: one shared-memory region in /dev/shm, mapped by every process that moves its bytes.

`CPUBackend` (backend.py) is the tier; `shm_names` names, claims, locks and sweeps its regions.
A YAML config names the tier `kvtier.tiers.cpu:CPUBackend` (or `cpu`). `RegionError` (a region
refused to map) is re-exported for the vLLM worker, which reports it.
"""

from kvtier.tiers.cpu.backend import CPUBackend, RegionError

__all__ = ["CPUBackend", "RegionError"]
