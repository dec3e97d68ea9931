"""`LRUOffloadingManager`: one backend, LRU eviction (the behaviour of vLLM's earlier `LRUOffloadingManager`), with
vLLM 0.32's per-request recency: a request's accesses are applied once, when it finishes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

from kvtier.control.request_access import RequestAccesses
from kvtier.control.store_threshold import DEFAULT_MAX_TRACKER_SIZE, StoreThreshold
from kvtier.core.interfaces import OffloadingManager, store_outcome
from kvtier.core.keys import OffloadKey
from kvtier.core.specs import LoadStoreSpec
from kvtier.core.types import (
    BlockStatus,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from kvtier.tiers.base import Backend


class LRUOffloadingManager(OffloadingManager):
    """Single-tier manager over any `Backend`, evicting the least recently used unpinned block.

    Recency as vLLM 0.32's `CPUOffloadingManager` with its `lru` policy keeps it: a stored block
    is the most recent when stored; a request's loads and the readable blocks it offers again are
    not applied when they happen but at `on_request_finished`, once each, together with the
    blocks the request stored, in the request's head-to-tail order (`kvtier.control.request_access`), so
    that its head ends up the most recently used. `touch` still applies at once."""

    def __init__(self, backend: Backend, enable_events: bool = False, store_threshold: int = 0,
                 max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE):
        """`store_threshold`: offers before a block is stored (`kvtier.control.store_threshold`; 0: off)."""
        self.backend = backend
        self.blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.accesses: RequestAccesses[OffloadKey] = RequestAccesses()
        self.store_threshold: StoreThreshold[OffloadKey] = StoreThreshold(store_threshold, max_tracker_size)

    def on_new_request(self, req_context: ReqContext | None = None) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        block = self.blocks.get(key)
        if block is None:
            return LookupResult.MISS
        return LookupResult.HIT if block.is_ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> LoadStoreSpec:
        blocks = []
        for key in keys:
            block = self.blocks[key]
            if not block.is_ready:
                raise KeyError(f"block {key.hex()} is not readable yet")
            block.ref_cnt += 1
            blocks.append(block)
        self.accesses.record(keys, req_context, reused=keys)
        return self.backend.get_load_store_spec(keys, blocks)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        for key in keys:
            block = self.blocks[key]
            assert block.ref_cnt > 0, f"complete_load without prepare_load for {key.hex()}"
            block.ref_cnt -= 1

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext | None = None) -> PrepareStoreOutput | None:
        keys = list(keys)
        to_store = [key for key in keys if key not in self.blocks]
        if self.store_threshold.enabled:
            keys = self.store_threshold.admit(keys, set(to_store))
            to_store = [key for key in keys if key not in self.blocks]
        ready = [key for key in keys if key in self.blocks and self.blocks[key].is_ready]
        self.accesses.record([key for key in keys if key not in self.blocks or self.blocks[key].is_ready],
                             req_context, reused=ready)
        need = len(to_store) - self.backend.get_num_free_blocks()
        evicted: list[OffloadKey] = []
        if need > 0:
            # The call's own keys are protected (the `OffloadingManager` contract): evicting one of
            # them would leave a hole in the request's prefix that no later lookup can pass.
            protected = set(keys)
            for key, block in self.blocks.items():
                if block.ref_cnt == 0 and key not in protected:
                    evicted.append(key)
                    if len(evicted) == need:
                        break
            else:
                return None
        for key in evicted:
            self.backend.free(self.blocks.pop(key))
        self._event(evicted, removed=True)
        blocks = self.backend.allocate_blocks(to_store)
        self.blocks.update(zip(to_store, blocks))
        self.accesses.inserted(to_store, req_context)
        return PrepareStoreOutput(to_store, self.backend.get_load_store_spec(to_store, blocks), evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext | bool | None = None,
                       success: bool = True) -> None:
        req_context, success = store_outcome(req_context, success)
        stored = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None or block.is_ready:
                continue
            if success:
                block.ref_cnt = 0
                stored.append(key)
            else:
                self.backend.free(self.blocks.pop(key))
        self._event(stored, removed=False)

    def _event(self, keys: list[OffloadKey], removed: bool) -> None:
        if keys and self.events is not None:
            self.events.append(OffloadingEvent(keys, self.backend.block_size, self.backend.medium, removed))

    def on_request_finished(self, req_context: ReqContext | None = None) -> None:
        """Apply the request's accesses (see the class docstring)."""
        self.touch(self.accesses.finish(req_context, insertions=True), req_context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            yield from self.events
            self.events.clear()

    def get_stats(self) -> dict | None:
        """`stores_skipped` (cumulative) when the store threshold is on, else None."""
        return {"stores_skipped": self.store_threshold.skipped} if self.store_threshold.enabled else None

    def reset_cache(self) -> None:
        self.accesses.clear()
        for key in [k for k, b in self.blocks.items() if b.ref_cnt == 0]:
            self.backend.free(self.blocks.pop(key))
