"""`Rounds`: the standalone API's stores, lookups and loads, in rounds of the first tier's room.

`KVTier` checks each call's arguments and runs it alone (its lock); `Rounds` does the work
between: a store goes in rounds of what the first tier can take without evicting a block not yet
copied below (`HierarchyManager` never does; it answers "no room yet" and this waits for the
copies), a lookup waits for promotions, a load goes in rounds of the first tier's room and stops
at the first block that failed (dropped by `complete_load(failed=)`: a MISS from then on).
Its waits are the caller's (`wait_idle`, `run`): they give up once the `KVTier` closes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.control.manager import HierarchyManager
from kvtier.core.keys import OffloadKey
from kvtier.core.specs import BlockIDsLoadStoreSpec, CompositeLoadStoreSpec, LoadStoreSpec
from kvtier.core.types import LookupResult, TransferResult
from kvtier.standalone.blocks import KeyBlocks
from kvtier.standalone.counters import TransferCounters

MAX_LOOKUP_ROUNDS = 1000  # RETRY rounds of one lookup
MAX_ROOM_ROUNDS = 1000  # waits for copies that make room, per store round (each one makes some)

log = logging.getLogger("kvtier.standalone")

ByKey = dict[OffloadKey, list[int]]  # key -> its engine block ids


class Rounds:
    """The work of `KVTier.store`, `lookup` and `load` (module docstring) over one hierarchy's
    `manager`; `run(src, dst)` runs one job on the worker plane and waits for its result."""

    def __init__(self, manager: HierarchyManager, blocks: KeyBlocks, counters: TransferCounters,
                 wait_idle: Callable[[], None], run: Callable[[LoadStoreSpec, LoadStoreSpec], TransferResult]):
        self.manager, self.blocks, self.counters = manager, blocks, counters
        self.wait_idle, self.run = wait_idle, run
        self.top = manager.tiers[0]

    # ------------------------------------------------------------------ store
    def store(self, pending: list[OffloadKey], by_key: ByKey) -> bool:
        """Store `pending` (keys the first tier does not hold) in rounds; whether all were stored."""
        ok = True
        while pending:
            n = self.room(len(pending))
            batch, pending = pending[:n], pending[n:]
            ok &= self._store_batch(batch, by_key)
        return ok

    def room(self, n: int) -> int:
        """How many of `n` new blocks the next round takes (at least one): what the first tier can
        take without dropping a block not yet below, after waiting for the copies down (started
        now for the next victims) when that is less than `n`; its capacity when it evicts freely."""
        stores, capacity = self.manager.stores, self.top.capacity
        room = stores.room()
        if room is None:
            return max(1, min(n, capacity))
        if room < n:
            stores.clean_ahead(min(n, capacity) - room)
            self.manager.on_schedule_end()
            self.wait_idle()
            room = stores.room() or 0
        return max(1, min(n, room))

    def _store_batch(self, keys: list[OffloadKey], by_key: ByKey) -> bool:
        manager = self.manager
        output = manager.prepare_store(keys)
        for _ in range(MAX_ROOM_ROUNDS):
            if output is not None or not manager.has_pending_work():
                break
            self.wait_idle()  # (room is being made by copies down, each call starting its next victims')
            output = manager.prepare_store(keys)
        if output is None:
            log.warning("store: %d block(s) not stored: tier %r has no room for them (every block is pinned by "
                        "a load or copy, or its copy to the next tier cannot be made: is that tier full?)",
                        len(keys), self.top.name)
            return False
        to_store = list(output.keys_to_store)
        if not to_store:
            return True
        order = self.blocks.group_order(to_store)
        result = self.run(self.blocks.gpu_spec([to_store[i] for i in order], by_key), output.store_spec.subset(order))
        manager.complete_store(to_store, success=result.success)
        self.counters.count("store", result, len(to_store))
        if not result.success:
            log.warning("store: %d block(s) not stored: the copy failed (%s)", len(to_store), result.error)
        return result.success

    # ------------------------------------------------------------------ lookup and load
    def loadable(self, keys: list[OffloadKey]) -> int:
        """How many leading `keys` a `load` would find: the HITs (`lookup`: blocks of lower tiers
        promoted as far as the first tier has room), then the run of the others that a tier
        holds (a lower tier's block, or a shared tier's key its probes found), which `load`
        brings up in rounds."""
        n = self.lookup(keys)
        source = self.manager.load_source
        while n < len(keys) and source(keys[n]) is not None:
            n += 1
        return n

    def lookup(self, keys: list[OffloadKey]) -> int:
        """How many leading `keys` are HITs, waiting while blocks are promoted (RETRY, HIT_PENDING)."""
        hits = 0
        for _ in range(MAX_LOOKUP_ROUNDS):
            hits, answer = self.manager.lookup_run(keys)  # leading HITs, then the first other answer
            if answer not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                return hits
            self.manager.on_schedule_end()
            self.wait_idle()
        return hits

    def load(self, keys: list[OffloadKey], by_key: ByKey) -> int:
        """Load the longest loadable prefix of `keys`, in rounds of the first tier's room; how
        many were loaded (up to the first block missing or failing)."""
        loaded = 0
        while loaded < len(keys):
            window = keys[loaded:loaded + self.room(len(keys) - loaded)]
            n = self.lookup(window)
            good = self._load_run(window[:n], by_key) if n else 0
            loaded += good
            if good < n or n == 0:
                break
        return loaded

    def _load_run(self, wanted: list[OffloadKey], by_key: ByKey) -> int:
        """Copy `wanted` (each answered HIT) into their engine blocks; how many leading ones were
        loaded. The blocks that failed (a read that did not verify, a failed copy) are dropped
        from their tier by `complete_load(failed=)`: a MISS from now on, the others kept."""
        source = self.manager.prepare_load(wanted)
        failed: list[OffloadKey] = []
        moved, seconds = 0, 0.0
        try:
            parts = source.parts if isinstance(source, CompositeLoadStoreSpec) else [(source, range(len(wanted)))]
            for spec, positions in parts:  # one job per source tier
                part_keys = [wanted[p] for p in positions]
                order = self.blocks.group_order(part_keys)
                assert isinstance(spec, BlockIDsLoadStoreSpec)
                result = self.run(spec.subset(order), self.blocks.gpu_spec([part_keys[i] for i in order], by_key))
                failed += [part_keys[order[j]] for j in result.failed_positions(len(order))]
                moved += result.transfer_size or 0
                seconds += result.transfer_time or 0.0
        finally:
            self.manager.complete_load(wanted, failed=failed)
        bad = set(failed)
        loaded = next((i for i, key in enumerate(wanted) if key in bad), len(wanted))
        # (the caller gets the prefix before the first failed block: blocks delivered after it are not counted)
        self.counters.count("load", TransferResult(0, True, moved * loaded // len(wanted), seconds), loaded)
        if failed:
            self.counters.count("load", TransferResult(0, False), len(failed))
        return loaded
