"""`FileLoadStoreSpec`: slots of a file tier, each with the key written in its header."""

from __future__ import annotations

from kvtier.core.specs import KeyedLoadStoreSpec


class FileLoadStoreSpec(KeyedLoadStoreSpec):
    """Slots of a file tier. `keys[i]` is the key stored in slot `block_ids[i]` (written in its header)."""

    __slots__ = ()

    @staticmethod
    def medium() -> str:
        return "FILE"
