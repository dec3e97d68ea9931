"""The hierarchy manager: the control plane over a chain of tiers.

Residence rules (checked by the Hypothesis state machine in tests/test_manager_state.py):
- Tier 0 receives every store. A block may be resident in several tiers at once; a tier-k copy is
  *clean* when the same block is also readable in tier k+1 (evicting it then loses nothing).
- A tier that cascades never evicts a *dirty* block (no readable copy below) to make room, under
  either mode: the copies of the dirty blocks among its next victims start first, only clean
  blocks are evicted, and when too few are, `prepare_store` answers None (no room yet; the engine
  asks again, the standalone `store` waits for the copies) and a promotion waits for the room.
  The one exception is a block whose copy failed (`cascade_dropped_failed`): a failing lower
  tier must not stop the first one. `prepare_store` never waits for a slower tier.
- Cascade `on_evict`: when free + clean + being-demoted slots of tier k fall below its low
  watermark, the manager asks the policy for its next victims and copies them to tier k+1 in the
  background (the tier-k copies stay pinned meanwhile), so that the next victims are clean by the
  time they are needed. Cascade `on_store` (write-through): every completed store is queued for a
  copy to tier k+1; copies start at once up to the in-flight limit, the rest wait in the queue and
  are started every step (`on_schedule_end`, `has_pending_work` says they wait) and as jobs finish.
- Lookup: tier 0 first. A readable block further down is a HIT when a handler can load it straight
  into the engine's KV cache (direct path); otherwise it is promoted into tier 0 (staged path) and
  the lookup answers RETRY until it lands. A block being written is HIT_PENDING.
- Pinned blocks (`ref_cnt > 0`: being loaded, demoted or promoted) and blocks being written
  (`ref_cnt == -1`) are never evicted, in any tier.

- A shared tier (`Backend.shared`, e.g. valkey) is last and outside the chain: tier 0 publishes
  its stores there, lookups of keys no tier holds are probed in one batch per step (RETRY
  meanwhile), and a block found there is promoted into tier 0 (`kvtier.control.shared_probes`).

The parts live in `kvtier.control`: per-tier state (`Tier`), jobs that do their own bookkeeping
(`Demotion`, `Promotion`, `Publish`), the controllers, peers over one `ControlContext` (tiers,
job table, events): `LoadPins`, `StorePath`, `Cascade`, `Promotions`, `SharedTierProbes`; and
the waits for their jobs at `wait_idle`, `flush` and `shutdown` (`Quiescer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from functools import partial
from typing import Any

from kvtier.control.cascade import Cascade
from kvtier.control.context import ControlContext
from kvtier.control.ended import absent, hold, mark_ended, unhold
from kvtier.control.jobs import EventLog, JobTable
from kvtier.control.loads import LoadPins
from kvtier.control.promotion import Promotions
from kvtier.control.quiesce import Quiescer
from kvtier.control.retention import Retention
from kvtier.control.shared_probes import SharedTierProbes, local_tiers
from kvtier.control.stores import StorePath
from kvtier.control.tier import Tier, TierStats
from kvtier.core.interfaces import OffloadingManager, store_outcome
from kvtier.core.keys import OffloadKey
from kvtier.core.specs import GPULoadStoreSpec, LoadStoreSpec
from kvtier.core.types import (
    CASCADE_MODES,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from kvtier.transfer.router import TransferRouter

__all__ = ["CASCADE_MODES", "HierarchyManager", "Tier", "TierStats"]

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60.0  # how long `shutdown` waits for running copies before abandoning them


def _link(tiers: list[Tier], router: TransferRouter) -> None:
    """Set each tier's position in the chain (`index`, `above`, `below`, `direct_load`); a shared
    tier is last and outside the cascade chain. ValueError for an unknown cascade mode."""
    n_local = local_tiers(tiers)
    for i, tier in enumerate(tiers):
        if tier.cascade not in CASCADE_MODES:
            raise ValueError(f"tier {tier.name!r}: cascade must be one of {CASCADE_MODES}, got {tier.cascade!r}")
        tier.index = i
        tier.above = tiers[i - 1] if 0 < i < n_local else None
        tier.below = tiers[i + 1] if i + 1 < n_local else None
        # Declared by the builder (its worker plane loads the tier), or routed by `router` itself.
        tier.direct_load = i > 0 and (tier.direct_load or
                                      router.handler_for(tier.backend.spec_type, GPULoadStoreSpec) is not None)


def _recover(ctx: ControlContext) -> None:
    """Adopt blocks that persistent backends found from an earlier process."""
    for tier in ctx.tiers:
        found = tier.backend.recover()
        if not found:
            continue
        keys = [k for k, _ in found]
        tier.table.insert_ready(keys, [b.block_id for _, b in found])
        log.info("tier %s: recovered %d blocks", tier.name, len(found))
        ctx.events.record(tier, keys, removed=False)
        above = tier.above
        if above is not None:
            above.clean.update(k for k in keys if above.table.get(k) is not None)


class HierarchyManager(OffloadingManager):
    """`OffloadingManager` across a chain of tiers; byte movement goes through a `TransferRouter`.

    It composes the controllers, peers over one `ControlContext`: `LoadPins` (loads), `stores`
    (a `StorePath`: stores into the first tier, and the room questions of the standalone API),
    `Cascade` (demotions), `Promotions` and, with a shared tier, `SharedTierProbes`."""

    def __init__(self, tiers: Sequence[Tier], router: TransferRouter, enable_events: bool = False):
        if not tiers:
            raise ValueError("a hierarchy needs at least one tier")
        self.tiers: list[Tier] = list(tiers)
        self.router = router
        _link(self.tiers, router)
        self._top = self.tiers[0]
        # sessions' retention hints (kvtier.control.retention), noted on each store and touch
        self.retention = Retention(self.tiers[0].capacity)
        ctx = self._ctx = ControlContext(self.tiers, JobTable(router), EventLog(enable_events), self.retention)
        self._jobs = ctx.jobs
        self._finished = router.finished  # the router's results not collected yet (`_drain`)
        self._cascade = Cascade(ctx)
        self.retention.on_ended = partial(mark_ended, self.tiers)
        self._last_turn: tuple[Any, Any] = (None, None)  # (request, keys) of the last hinted `_note_turn`
        self.retention.on_hold, self.retention.on_unhold = partial(hold, self.tiers), partial(unhold, self.tiers)
        self.retention.absent = partial(absent, self.tiers)
        for tier in self.tiers:
            tier.retained, tier.retained_left = self.retention.retained, self.retention.left
        self._promotions = Promotions(ctx, self._cascade.evict_for)
        self._loads = LoadPins(ctx)
        self._shared = (SharedTierProbes(ctx, self._promotions, self._cascade.make_room)
                        if local_tiers(self.tiers) < len(self.tiers) else None)
        self.stores = StorePath(ctx, self._cascade, self._promotions, self._shared)
        self._writes_through = any(t.cascade == "on_store" for t in self.tiers[:-1])  # as `Cascade` finds them
        self._refilled = [t for t in self.tiers[:-1] if t.cascades_on_evict]  # `refill_reserve` has work
        self._alone = len(self.tiers) == 1  # no lower or shared tier: no promotion, probe or copy
        self._quiescer = Quiescer(ctx, router, self._cascade, self._promotions, self._shared)
        _recover(ctx)

    @property
    def events(self) -> list[OffloadingEvent] | None:
        """Events not taken yet (None when events are off)."""
        return self._ctx.events.events

    def _drain(self) -> None:
        """Account for the jobs the router reported (one test of its queue when none did)."""
        if self._finished:
            self._jobs.drain()

    def _note_turn(self, req_context: ReqContext | None, keys: Collection[OffloadKey],
                   stored: Collection[OffloadKey] = ()) -> None:
        """A request used `keys`, storing `stored` of them: they join the session its retention
        hint names (`Retention.note_turn`; a request without `kv_transfer_params` carries none,
        so the retention is not asked), and unless that session ended with this request, they
        are no ended session's first victims any more (used again). A call repeating the one
        before it (the same request and keys, nothing stored: a load's `touch`) changes nothing."""
        hint = None
        if req_context is not None and getattr(req_context, "kv_transfer_params", None):
            last = self._last_turn
            if not stored and last[0] is req_context and last[1] == keys:
                return
            self._last_turn = (req_context, keys)
            hint = self.retention.note_turn(req_context, keys, stored)
        if hint is None or not hint.ended:
            for tier in self.tiers:
                if tier.first_victims:
                    for key in tier.first_victims.keys() & keys:
                        del tier.first_victims[key]

    # ------------------------------------------------------------------ protocol
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        self._drain()
        top = self._top
        block = top.table.get(key)
        if block is not None and top.condemned and key in top.condemned:
            block = None  # (failed a read, still pinned by another load: never served again)
        if block is not None and block.ref_cnt >= 0:
            return LookupResult.HIT
        promotions = self._promotions
        if key in promotions.running:
            return LookupResult.RETRY
        if block is not None:
            return LookupResult.HIT_PENDING
        if promotions.refused and promotions.take_refusal(key):
            return LookupResult.MISS
        for tier in self.tiers[1:]:
            block = tier.table.get(key)
            if block is None or (tier.condemned and key in tier.condemned):
                continue
            if not block.is_ready:
                return LookupResult.HIT_PENDING
            if tier.direct_load:
                return LookupResult.HIT
            promotions.request(key, tier)
            return LookupResult.RETRY
        return LookupResult.MISS if self._shared is None else self._shared.lookup(key)

    def lookup_run(self, keys: Sequence[OffloadKey],
                   req_context: ReqContext | None = None) -> tuple[int, LookupResult | None]:
        """Look `keys` up in order until the first answer that is not HIT: returns how many
        leading keys are HITs and that first other answer (None when every key is a HIT).
        The same answers and side effects as calling `lookup` on each key and stopping there
        (with a shared tier, a RETRY also starts probes or promotions of the keys after it, as
        vLLM's scan past a RETRY would); the leading run of readable tier-0 blocks is found in C loops."""
        self._drain()
        keys = keys if isinstance(keys, list) else list(keys)
        n = self._loads.top_run(keys)
        if n == len(keys):
            return n, None
        if self._alone:
            # (`lookup` for one tier: nothing is promoted or probed; the key is not readable there)
            top, key = self._top, keys[n]
            gone = top.table.get(key) is None or (top.condemned and key in top.condemned)
            return n, LookupResult.MISS if gone else LookupResult.HIT_PENDING
        lookup = self.lookup
        for key in keys[n:]:
            result = lookup(key, req_context)
            if result is not LookupResult.HIT:
                if result is LookupResult.RETRY and self._shared is not None:
                    self._shared.prefetch(keys[n + 1:])
                return n, result
            n += 1
        return n, None

    def load_source(self, key: OffloadKey) -> str | None:
        """Medium of the tier that supplies `key` to the engine: the tier a promotion into tier 0
        came from (until the block is loaded), else the first tier holding it readable."""
        origin = self._top.promoted_from.get(key, self._promotions.running.get(key))
        if origin is not None:
            return self.tiers[origin].medium
        for tier in self.tiers:
            if tier.readable(key) is not None:
                return tier.medium
        return None

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> LoadStoreSpec:
        keys = keys if isinstance(keys, list) else list(keys)
        spec = self._loads.prepare(keys)
        self._note_turn(req_context, keys)  # (a hit of the session's blocks: its retention starts again)
        return spec

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        for tier in self.tiers:
            tier.table.touch(keys)
        self._note_turn(req_context, keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None,
                      failed: Collection[OffloadKey] = ()) -> None:
        """Release the pins `prepare_load` took. `failed`: the keys whose load failed in the
        engine (a block that did not verify, a failed copy): each is dropped from the tier it was
        read from, counted once in its `failures`, and never answered HIT again; the other
        blocks of the load stay (`LoadPins.complete`)."""
        self._loads.complete(keys if isinstance(keys, list) else list(keys), failed)

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext | None = None) -> PrepareStoreOutput | None:
        self._drain()
        if self._writes_through:
            self._cascade.advance_writes()
        out = self.stores.prepare(keys)
        self._note_turn(req_context, keys, () if out is None else out.keys_to_store)
        return out

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext | bool | None = None,
                       success: bool = True) -> None:
        _, success = store_outcome(req_context, success)  # (vLLM's earlier form passes the outcome second)
        self.stores.complete(keys if isinstance(keys, list) else list(keys), success)

    def on_request_finished(self, req_context: ReqContext | None = None) -> None:
        return

    def on_schedule_end(self, context: Any = None) -> None:
        self._drain()
        if self._writes_through:
            self._cascade.advance_writes()
        if self._shared is not None:
            self._shared.step()  # before the flush: blocks its probes found are promoted this step
        if self._promotions.queue:
            self._promotions.flush()
        for tier in self._refilled:
            self._cascade.refill_reserve(tier)

    def has_pending_work(self) -> bool:
        """Jobs in flight, promotions queued, write-through copies waiting for in-flight room (not
        those waiting for room in a full lower tier: stepping an idle engine cannot free it), or
        keys of a shared tier waiting for their probe."""
        return (bool(self._jobs) or bool(self._promotions.queue) or self._cascade.writes_waiting()
                or (self._shared is not None and self._shared.has_pending_work()))

    def flush(self, timeout: float | None = None, check: Callable[[], None] | None = None) -> int:
        """Copy every readable block of each cascading tier (cascade not `none`) that the next
        tier lacks down to it, tier after tier, and wait for the copies. Returns how many blocks
        are still without a copy below: no room there, a failed copy (each block is tried once),
        or `timeout` seconds passed first (None: no limit; the copies left running finish later).
        `check` is called every `quiesce.FLUSH_RECHECK_S` while waiting: what it raises ends the
        flush (the copies started go on; the standalone API's `ClosedError` once another thread
        closes)."""
        return self._quiescer.flush(timeout, check)

    def take_events(self) -> Iterable[OffloadingEvent]:
        yield from self._ctx.events.take()

    def reset_cache(self) -> None:
        """Evict every unpinned, readable block from every tier."""
        self._jobs.drain()
        for tier in self.tiers:
            self._ctx.events.record(tier, tier.remove(list(tier.table.keys())), removed=True)

    def finish_reset(self, storing: Collection[OffloadKey], loading: Collection[OffloadKey]) -> list[OffloadKey]:
        """Finish a `reset_cache` that found engine jobs in flight, once the engine has flushed
        them (no transfer writes or reads their slots any more) and will never complete them.
        `storing`: keys of the engine's flushed stores (first tier, still being written): dropped,
        their slots freed. `loading`: keys of its flushed loads, once per `prepare_load` pin:
        unpinned, then dropped unless pinned again since from the tier each was read from (the
        reset evicts them now; `LoadPins.drop`). Returns the keys dropped (reported as removed
        events)."""
        return self._loads.drop(list(loading)) + self.stores.finish_reset(storing)

    def get_stats(self, retained: bool = True) -> dict[str, Any]:
        """Per-tier counters and occupancy, with the blocks of the tier that sessions' retentions
        keep (`retained_blocks`; left out with `retained` False: counting them looks each retained
        block up in every tier, which a caller asking every scheduler step does less often) and
        those of ended sessions waiting to go first (`ended_blocks`)."""
        rows = {tier.name: {**tier.stats_row(), "ended_blocks": len(tier.first_victims)} for tier in self.tiers}
        held = self.retention.held()  # (sessions that ran out released first; only the keys are read)
        if retained:
            for tier in self.tiers:  # (`absent`: one C loop over the keys in a compiled table)
                rows[tier.name]["retained_blocks"] = len(held) - len(tier.table.absent(held)) if held else 0
        return rows

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every job the manager started has finished and been accounted, every
        write-through copy that can start has, and a shared tier's probes in flight answered
        (tests, bench, shutdown, the standalone API). With a `timeout` (seconds)
        raises `WaitTimeout`, naming the jobs still running, when they have not all finished by
        then (a hung handler); None waits as long as it takes."""
        self._quiescer.wait_idle(timeout)

    def shutdown(self, timeout: float | None = SHUTDOWN_TIMEOUT_S, keep_open: Collection[str] = ()) -> None:
        """Wait up to `timeout` seconds for running copies, then shut the router down and close the
        backends but those of the tiers named in `keep_open` (used by engine copies abandoned
        still running: `Hierarchy.close`). Copies still running then are abandoned and logged:
        the router (whose shutdown would wait for them) and the backends they use are left open,
        since a copy may still be writing into them; the other backends are closed."""
        self._quiescer.shutdown(timeout, set(keep_open))
