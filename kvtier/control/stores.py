"""`StorePath`: the engine's stores into the first tier, from `prepare_store` to `complete_store`.

`prepare` skips the keys the first tier holds, makes room (`Cascade.evict_for`: eviction that
respects the cascade) and inserts the new blocks being written (`enter_copies`, tail first);
`complete` makes them readable (`mark_written`) or removes them, then hands the readable ones to
the cascade (recorded clean when the next tier holds them, queued for write-through) and to the
shared tier (published). The room questions of the standalone API (`new_keys`, `room`,
`clean_ahead`) and the end of a cache reset (`finish_reset`) live here too.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from kvtier.control.cascade import Cascade, split_below
from kvtier.control.context import ControlContext
from kvtier.control.promotion import Promotions
from kvtier.control.shared_probes import SharedTierProbes
from kvtier.control.tier import UNPINNED, WRITING, enter_copies
from kvtier.core.keys import OffloadKey
from kvtier.core.types import PrepareStoreOutput


class StorePath:
    """The store path of a hierarchy's first tier (see the module docstring)."""

    def __init__(self, ctx: ControlContext, cascade: Cascade, promotions: Promotions,
                 shared: SharedTierProbes | None):
        self._ctx = ctx
        self._top = ctx.top
        self._cascade = cascade
        self._promotions = promotions
        self._shared = shared
        self._refills = ctx.top.cascades_on_evict  # `refill_reserve` has work after a store

    def prepare(self, keys: Collection[OffloadKey]) -> PrepareStoreOutput | None:
        """`OffloadingManager.prepare_store` (jobs already drained): None when there is no room. A
        key given more than once is stored once (one slot, listed once in `keys_to_store`)."""
        top = self._top
        to_store = top.table.absent(keys)
        if len(to_store) > 1 and len(set(to_store)) < len(to_store):
            to_store = list(dict.fromkeys(to_store))  # (a key given twice gets one slot)
        if self._promotions.queue:
            self._promotions.supersede(to_store)  # the engine's own bytes supersede a promotion not started yet
        # Only resident keys can be victims: when none of `keys` is, none needs protecting.
        evicted = self._cascade.evict_for(top, len(to_store), keys if len(to_store) != len(keys) else ())
        if evicted is None:
            return None
        spec = top.backend.spec_for_ids(to_store, enter_copies(top, to_store, tail_first=True))
        top.allocated_since_walk += len(to_store)
        if self._refills:
            try:
                self._cascade.refill_reserve(top)
            except BaseException:  # (a user policy's `victims` raised: no slot stays "being written")
                top.remove(to_store, WRITING)
                raise
        return PrepareStoreOutput(to_store, spec, evicted)

    def complete(self, keys: list[OffloadKey], success: bool) -> None:
        """`OffloadingManager.complete_store`: the keys still being written and not promoted are
        made readable (`success`) or removed; the others are left as they are."""
        top, promoting, events = self._top, self._promotions.running, self._ctx.events
        if success and not promoting and top.table.mark_written(keys):
            changed = keys  # the common case (each key prepared once), made readable and unpinned in one pass
        else:
            get = top.table.get  # (the keys still being written, each once)
            changed = [k for k in dict.fromkeys(keys)
                       if k not in promoting and (b := get(k)) is not None and b.ref_cnt == -1]
            if not success:
                top.remove(changed, WRITING)
                top.stats.failures += len(changed)
                return
            top.table.mark_written(changed)
        top.stats.stores += len(changed)
        if events.events is not None:
            events.record(top, changed, removed=False)
        if top.below is not None:
            split_below(top, changed)  # (those readable below are clean)
            if top.cascade == "on_store":
                self._cascade.queue_writes(top, [k for k in changed if k not in top.clean])
        if self._shared is not None:
            self._shared.publish(changed)

    def new_keys(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys `prepare` would allocate in the first tier: those it does not hold."""
        return self._top.table.absent(keys)

    def room(self) -> int | None:
        """How many new blocks the first tier can take now without evicting a block whose copy to
        the next tier has not been made (its free slots plus its clean blocks), when it cascades
        (`on_evict` or `on_store`); None when it does not (one tier, or cascade `none`: it evicts
        freely)."""
        top = self._top
        if top.below is None or top.cascade == "none":
            return None
        return top.backend.get_num_free_blocks() + len(top.clean)

    def clean_ahead(self, count: int) -> None:
        """Start copying the dirty blocks among the first tier's next `count` victims to the next
        tier now (`on_evict`; a caller about to wait for room, see `room`)."""
        self._cascade.clean_ahead(self._top, count)

    def finish_reset(self, storing: Collection[OffloadKey]) -> list[OffloadKey]:
        """`HierarchyManager.finish_reset`'s flushed stores (its docstring is the contract; its
        flushed loads are `LoadPins.drop`'s): the keys dropped."""
        top = self._top
        promoting = self._promotions.running
        dropped = top.remove([key for key in storing if key not in promoting], UNPINNED)
        self._ctx.events.record(top, dropped, removed=True)
        return dropped
