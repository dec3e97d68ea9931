"""`RegionMap`: an engine's mapping of the host owner's CPU region, and the copies over it.

The owner names its region (`shm_name`, geometry, `token`) in every `hello`; an engine maps
exactly that region (`CPUBackend.attach` checks the token) and builds the worker plane between its
KV caches and it. A restarted owner has a new region: the next copy that names it maps it and
drops the old mapping (the old region's memory goes with its last mapping).
"""

from __future__ import annotations

from typing import Any

from kvtier.tiers.cpu import CPUBackend


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
        backend = CPUBackend.attach(region["shm_name"], region["num_blocks"], region["block_bytes"], name=tier,
                                    pin=self.pin, token=region["token"])
        try:
            self._plane = build_worker_plane({tier: backend}, self.kv_caches)
        except BaseException:
            backend.close()
            raise
        self.backend = backend
        return self._plane

    def close(self) -> None:
        """Stop the plane and unmap the region (the owner's region stays). Idempotent."""
        if self._plane is not None:
            self._plane.shutdown()
            self._plane = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
