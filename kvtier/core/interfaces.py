"""`OffloadingManager`: the scheduler-side protocol (vLLM's `OffloadingManager`, every method).

Every call runs on the scheduler thread and must never block on I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from typing import Any

from kvtier.core.keys import OffloadKey
from kvtier.core.specs import LoadStoreSpec
from kvtier.core.types import LookupResult, OffloadingEvent, PrepareStoreOutput, ReqContext, RequestOffloadingContext


def store_outcome(req_context: Any, success: bool) -> tuple[Any, bool]:
    """`complete_store`'s request context and outcome, whichever form the call took: vLLM's
    `complete_store(keys, req_context, success)` or its earlier `complete_store(block_hashes,
    success)`, whose second argument is the outcome (a bool is never a request context)."""
    if isinstance(req_context, bool):
        return None, req_context
    return req_context, success


class OffloadingManager(ABC):
    """Tracks which blocks are offloaded, where, and which may be evicted.

    Every call takes the request's context (`ReqContext`) as vLLM passes it; kvtier's managers
    also take vLLM's earlier forms, without one (`prepare_store(block_hashes)`,
    `complete_store(block_hashes, success)`) or with None: such a call belongs to no request,
    so it is not counted in any request's recency (`touch` is then the way to mark use)."""

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether one block is held: HIT (readable), HIT_PENDING (being written), RETRY (ask again
        later, e.g. while it is promoted), MISS."""

    def lookup_prefix(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> int:
        """How many leading `keys` are readable now: the scan stops at the first block that is
        missing or not ready (any answer but HIT)."""
        hits = 0
        for key in keys:
            if self.lookup(key, req_context) is not LookupResult.HIT:
                break
            hits += 1
        return hits

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the given (HIT) blocks until `complete_load` and return where to read them."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark blocks as recently used."""
        return

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin blocks pinned by `prepare_load`."""
        return

    @abstractmethod
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Allocate room for the keys not held yet (evicting if needed); None when there is no room."""

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Make stored blocks readable, or free them when `success` is False."""
        return

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """A request was first seen by the scheduler."""

    def on_request_finished(self, req_context: ReqContext) -> None:
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events collected since the last call."""
        return ()

    def on_schedule_end(self, context: Any = None) -> None:
        """End of a scheduler step: flush deferred work."""
        return

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> None:
        """Evict every unpinned block and reset internal state."""
        return

    def get_stats(self) -> dict | None:
        return None

    def shutdown(self) -> None:
        return
