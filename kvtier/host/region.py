"""`RegionMap`: an engine's mapping of the host owner's CPU region, and the copies over it.

The owner names its region (`shm_name`, geometry, `token`) in every `hello`; an engine maps
exactly that region (`CPUBackend.attach` checks the token) and builds the worker plane between its
KV caches and it. A restarted owner has a new region: the next copy that names it maps it and
drops the old mapping (the old region's memory goes with its last mapping). `map_region` is the
one way both front-ends map it: this module's `RegionMap` (the standalone engine) and the vLLM
worker's `HostRegionPlanes` (which also keeps an old region's jobs in flight to their end).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.tiers.cpu import CPUBackend

_T = TypeVar("_T")


def map_region(region: dict[str, Any], tier: str, pin: str | bool, build: Callable[[CPUBackend], _T],
               block_tokens: int = 0) -> tuple[CPUBackend, _T]:
    """Map the owner's region that `region` names (`shm_name`, `num_blocks`, `block_bytes`, `token`:
    `CPUBackend.attach` refuses a region whose token differs) and build `build(backend)` over it
    (the copies' planes); the mapping is dropped again if building fails."""
    backend = CPUBackend.attach(region["shm_name"], region["num_blocks"], region["block_bytes"], block_tokens,
                                name=tier, pin=pin, token=region["token"])
    try:
        return backend, build(backend)
    except BaseException:
        backend.close()
        raise


class RegionMap:
    """The owner's region as this engine maps it, with its worker plane."""

    def __init__(self, kv_caches: Any, pin: str = "auto"):
        self.kv_caches = kv_caches
        self.pin = pin
        self.backend: CPUBackend | None = None
        self._plane: Any = None

    def plane(self, region: dict[str, Any], tier: str) -> Any:
        """The worker plane over `region` (mapped now if it is not the one mapped)."""
        if self.backend is not None and self.backend.token == region["token"]:
            return self._plane
        from kvtier.transfer.planes import build_worker_plane

        self.close()
        self.backend, self._plane = map_region(region, tier, self.pin,
                                               lambda backend: build_worker_plane({tier: backend}, self.kv_caches))
        return self._plane

    def close(self) -> None:
        """Stop the plane and unmap the region (the owner's region stays). Idempotent."""
        if self._plane is not None:
            self._plane.shutdown()
            self._plane = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
