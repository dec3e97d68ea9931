"""`TransferCounters`: the store/load totals `KVTier.stats()` reports under `"engine"`, in blocks.

Each total counts blocks (or their bytes and seconds), never calls or rounds: storing 50 blocks
in one call adds 50 to `stores`, however many rounds it took. `HELP` says what each total is, in
words (the Prometheus endpoint's HELP text).
"""

from __future__ import annotations

from typing import Any

from kvtier.core.types import TransferResult

HELP = {
    "stores": "blocks copied from the engine into the hierarchy by KVTier.store",
    "store_failures": "blocks KVTier.store could not copy into the hierarchy (a failed copy)",
    "store_bytes": "bytes of the blocks KVTier.store copied into the hierarchy",
    "store_seconds": "seconds spent copying blocks from the engine into the hierarchy",
    "loads": "blocks copied from the hierarchy into engine blocks by KVTier.load",
    "load_failures": "blocks KVTier.load could not copy into the engine (a failed copy: recomputed)",
    "load_bytes": "bytes of the blocks KVTier.load copied into the engine",
    "load_seconds": "seconds spent copying blocks from the hierarchy into the engine",
    "stores_skipped": "blocks KVTier.store did not store: offered fewer than store_threshold times",
}


class TransferCounters:
    """Blocks, failed blocks, bytes and seconds of the engine's stores and loads through `KVTier`."""

    KINDS = ("store", "load")

    def __init__(self) -> None:
        self._totals: dict[str, Any] = {}
        for kind in self.KINDS:
            self._totals.update({f"{kind}s": 0, f"{kind}_failures": 0, f"{kind}_bytes": 0, f"{kind}_seconds": 0.0})
        self._totals["stores_skipped"] = 0

    def count(self, kind: str, result: TransferResult, blocks: int) -> None:
        """Add one finished copy of `blocks` blocks of `kind` ("store" or "load"): the blocks,
        their bytes and seconds when it succeeded, `blocks` failures when it did not."""
        totals = self._totals
        if result.success:
            totals[f"{kind}s"] += blocks
            totals[f"{kind}_bytes"] += result.transfer_size or 0
            totals[f"{kind}_seconds"] += result.transfer_time or 0.0
        else:
            totals[f"{kind}_failures"] += blocks

    def skip(self, blocks: int) -> None:
        """Add `blocks` blocks the store threshold kept out (`kvtier.control.store_threshold`)."""
        self._totals["stores_skipped"] += blocks

    def as_dict(self) -> dict[str, Any]:
        """A copy of the totals (`stores`, `store_failures`, `store_bytes`, `store_seconds`, the
        same for loads, and `stores_skipped`; see `HELP`)."""
        return dict(self._totals)
