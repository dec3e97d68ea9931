"""`RemoteLoadStoreSpec`: handles of a shared tier's values, each addressed by its key."""

from __future__ import annotations

from kvtier.core.specs import KeyedLoadStoreSpec


class RemoteLoadStoreSpec(KeyedLoadStoreSpec):
    """Handles of a shared remote tier (Valkey/Redis). `block_ids[i]` is the tier's local handle
    of the value stored under `keys[i]` on the server; the bytes are addressed by the key."""

    __slots__ = ()

    @staticmethod
    def medium() -> str:
        return "REMOTE"
