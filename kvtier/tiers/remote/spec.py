"""`RemoteLoadStoreSpec`: handles of a shared tier's values, each addressed by its key."""

from __future__ import annotations

from kvtier.core.specs import CPULoadStoreSpec, KeyedLoadStoreSpec


class RemoteLoadStoreSpec(KeyedLoadStoreSpec):
    """Handles of a shared remote tier (Valkey/Redis). `block_ids[i]` is the tier's local handle
    of the value stored under `keys[i]` on the server; the bytes are addressed by the key."""

    __slots__ = ()

    @staticmethod
    def medium() -> str:
        return "REMOTE"


# The hops of the valkey kind (`Backend.handlers`): its handler, next to the backend, in both directions.
HOPS = (
    (CPULoadStoreSpec, RemoteLoadStoreSpec, "kvtier.tiers.remote.handler:make_cpu_to_remote"),
    (RemoteLoadStoreSpec, CPULoadStoreSpec, "kvtier.tiers.remote.handler:make_remote_to_cpu"),
)
