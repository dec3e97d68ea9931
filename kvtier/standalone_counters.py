"""`TransferCounters`: the store/load totals `KVTier.stats()` reports under `"engine"`."""

from __future__ import annotations

from typing import Any

from kvtier.types import TransferResult


class TransferCounters:
    """Jobs, failures, bytes and seconds of the engine's stores and loads through `KVTier`."""

    KINDS = ("store", "load")

    def __init__(self) -> None:
        self._totals: dict[str, Any] = {}
        for kind in self.KINDS:
            self._totals.update({f"{kind}s": 0, f"{kind}_failures": 0, f"{kind}_bytes": 0, f"{kind}_seconds": 0.0})
        self._totals["stores_skipped"] = 0  # blocks not stored: offered fewer than store_threshold times

    def count(self, kind: str, result: TransferResult) -> None:
        """Add one finished job of `kind` ("store" or "load"): its bytes and seconds when it
        succeeded, one failure when it did not."""
        totals = self._totals
        if result.success:
            totals[f"{kind}s"] += 1
            totals[f"{kind}_bytes"] += result.transfer_size or 0
            totals[f"{kind}_seconds"] += result.transfer_time or 0.0
        else:
            totals[f"{kind}_failures"] += 1

    def skip(self, blocks: int) -> None:
        """Add `blocks` blocks the store threshold kept out (`kvtier.store_threshold`)."""
        self._totals["stores_skipped"] += blocks

    def as_dict(self) -> dict[str, Any]:
        """A copy of the totals (`stores`, `store_failures`, `store_bytes`, `store_seconds`, the
        same for loads, and `stores_skipped`)."""
        return dict(self._totals)
