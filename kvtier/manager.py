"""The hierarchy manager: the control plane over a chain of tiers.

Residence rules (checked by the Hypothesis state machine in tests/test_manager_state.py):
- Tier 0 receives every store. A block may be resident in several tiers at once; a tier-k copy is
  *clean* when the same block is also readable in tier k+1 (evicting it then loses nothing).
- Cascade `on_evict`: when free + clean + being-demoted slots of tier k fall below its low
  watermark, the manager asks the policy for its next victims and copies them to tier k+1 in the
  background (the tier-k copies stay pinned meanwhile). `prepare_store` therefore never waits for a
  slower tier; a dirty block evicted anyway (the lower tier could not keep up) is counted as
  `cascade_dropped`. Cascade `on_store` (write-through): every completed store is queued for a copy
  to tier k+1; copies start at once up to the in-flight limit, the rest wait in the queue and are
  started every step (`on_schedule_end`, `has_pending_work` says they wait) and as jobs finish.
  While the next tier takes copies, eviction takes only written blocks: when too few remain, the
  queued copies of the next victims start first and `prepare_store` answers None (no room yet;
  the engine asks again). A dirty block is evicted only when its copy failed
  (`cascade_dropped_failed`) or the next tier had no room for it or dropped its copy
  (`cascade_dropped_full`).
- Lookup: tier 0 first. A readable block further down is a HIT when a handler can load it straight
  into the engine's KV cache (direct path); otherwise it is promoted into tier 0 (staged path) and
  the lookup answers RETRY until it lands. A block being written is HIT_PENDING.
- Pinned blocks (`ref_cnt > 0`: being loaded, demoted or promoted) and blocks being written
  (`ref_cnt == -1`) are never evicted, in any tier.

- A shared tier (`Backend.shared`, e.g. valkey) is last and outside the chain: tier 0 publishes
  its stores there, lookups of keys no tier holds are probed in one batch per step (RETRY
  meanwhile), and a block found there is promoted into tier 0 (`kvtier.control.shared`).

The parts live in `kvtier.control`: per-tier state (`Tier`), jobs that do their own bookkeeping
(`Demotion`, `Promotion`), the two controllers that start them (`Cascade`, `Promotions`), and
the waits for them at `wait_idle`, `flush` and `shutdown` (`Quiescer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from kvtier.control.cascade import Cascade, split_below
from kvtier.control.jobs import EventLog, JobTable, enter_copies
from kvtier.control.loads import LoadPins
from kvtier.control.promotion import Promotions
from kvtier.control.quiesce import Quiescer
from kvtier.control.shared import SharedTier, local_tiers
from kvtier.control.tier import Tier, TierStats
from kvtier.engine import TransferEngine
from kvtier.interfaces import OffloadingManager
from kvtier.keys import OffloadKey
from kvtier.specs import GPULoadStoreSpec, LoadStoreSpec
from kvtier.types import (
    CASCADE_MODES,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

__all__ = ["CASCADE_MODES", "HierarchyManager", "Tier", "TierStats"]

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60.0  # how long `shutdown` waits for running copies before abandoning them



def _enter_new(top: Tier, keys: list[OffloadKey]) -> LoadStoreSpec:
    """Allocate a request's new blocks in tier 0 and insert them being written (pinned); where
    they are. Tail first, so that the head of a prefix ends up the most recently used; the last
    new block is the request's tail (`enter_copies` with `tail_first`)."""
    return top.backend.spec_for_ids(keys, enter_copies(top, keys, tail_first=True))


class HierarchyManager(OffloadingManager):
    """`OffloadingManager` across a chain of tiers; byte movement goes through a `TransferEngine`."""

    def __init__(self, tiers: Sequence[Tier], engine: TransferEngine, enable_events: bool = False):
        if not tiers:
            raise ValueError("a hierarchy needs at least one tier")
        self.tiers: list[Tier] = list(tiers)
        self.engine = engine
        n_local = local_tiers(self.tiers)  # a shared tier is last and outside the cascade chain
        for i, tier in enumerate(self.tiers):
            if tier.cascade not in CASCADE_MODES:
                raise ValueError(f"tier {tier.name!r}: cascade must be one of {CASCADE_MODES}, got {tier.cascade!r}")
            tier.index = i
            tier.above = self.tiers[i - 1] if 0 < i < n_local else None
            tier.below = self.tiers[i + 1] if i + 1 < n_local else None
            # Declared by the builder (its worker plane loads the tier), or routed by `engine` itself.
            tier.direct_load = i > 0 and (tier.direct_load or
                                          engine.handler_for(tier.backend.spec_type, GPULoadStoreSpec) is not None)
        self._top = self.tiers[0]
        self._log = EventLog(enable_events)
        self._jobs = JobTable(engine)
        self._results_waiting = engine.has_finished  # bound once: `lookup` asks on every call
        self._cascade = Cascade(self.tiers, self._jobs, self._log)
        self._promotions = Promotions(self.tiers, self._jobs, self._cascade, self._log)
        self._loads = LoadPins(self.tiers)
        self._shared = (SharedTier(self.tiers, self._jobs, self._cascade, self._promotions, self._log)
                        if n_local < len(self.tiers) else None)
        self._writes_through = any(t.cascade == "on_store" for t in self.tiers[:-1])  # as `Cascade` finds them
        self._refilled = [t for t in self.tiers[:-1] if t.cascades_on_evict]  # `refill_reserve` has work
        self._alone = len(self.tiers) == 1  # no lower or shared tier: no promotion, probe or copy
        self._quiescer = Quiescer(self.tiers, engine, self._jobs, self._cascade, self._promotions, self._shared)
        self._recover()
        for tier in self.tiers:
            # Evictable accounting: every ref_cnt change below reports pin/unpin to the policy.
            tier.policy.track_pins()

    @property
    def events(self) -> list[OffloadingEvent] | None:
        """Events not taken yet (None when events are off)."""
        return self._log.events

    # ------------------------------------------------------------------ setup
    def _recover(self) -> None:
        """Adopt blocks that persistent backends found from an earlier process."""
        for tier in self.tiers:
            found = tier.backend.recover()
            for key, block in found:
                tier.policy.insert(key, block)
            if found:
                log.info("tier %s: recovered %d blocks", tier.name, len(found))
                self._log.record(tier, [k for k, _ in found], removed=False)
                above = tier.above
                if above is not None:
                    above.clean.update(k for k, _ in found if above.policy.get(k) is not None)

    # ------------------------------------------------------------------ protocol
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        if self._results_waiting():
            self._jobs.drain()
        block = self._top.policy.get(key)
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
            block = tier.policy.get(key)
            if block is None:
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
        if self._results_waiting():
            self._jobs.drain()
        keys = keys if isinstance(keys, list) else list(keys)
        n = self._loads.top_run(keys)
        if n == len(keys):
            return n, None
        if self._alone:
            # (`lookup` for one tier: nothing is promoted or probed; the key is not readable there)
            return n, LookupResult.MISS if self._top.policy.get(keys[n]) is None else LookupResult.HIT_PENDING
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
        return self._loads.prepare(keys if isinstance(keys, list) else list(keys))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        for tier in self.tiers:
            tier.policy.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self._loads.complete(keys if isinstance(keys, list) else list(keys))

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext | None = None) -> PrepareStoreOutput | None:
        if self._results_waiting():
            self._jobs.drain()
        if self._writes_through:
            self._cascade.advance_writes()
        top = self._top
        to_store = top.policy.absent(keys)
        if self._promotions.queue:
            self._promotions.supersede(to_store)  # the engine's own bytes supersede a promotion not started yet
        # Only resident keys can be victims: when none of `keys` is, none needs protecting.
        evicted = self._cascade.evict_for(top, len(to_store), keys if len(to_store) != len(keys) else ())
        if evicted is None:
            return None
        spec = _enter_new(top, to_store)
        top.allocated_since_walk += len(to_store)
        if self._refilled:
            self._cascade.refill_reserve(top)
        return PrepareStoreOutput(to_store, spec, evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None,
                       success: bool = True) -> None:
        top = self._top
        promoting = self._promotions.running
        keys = keys if isinstance(keys, list) else list(keys)
        if not (success and not promoting and top.policy.mark_written(keys)):
            # (not the common case, each key prepared once, made readable and unpinned in one pass)
            changed = [k for k in top.being_written(keys) if k not in promoting]
            if not success:
                top.discard_written(changed)
                top.stats.failures += 1 if changed else 0
                return
            top.policy.mark_written(changed)
        else:
            changed = keys
        top.stats.stores += len(changed)
        if self._log.events is not None:
            self._log.record(top, changed, removed=False)
        if top.below is not None:
            split_below(top, changed)  # (those readable below are clean)
            if top.cascade == "on_store":
                self._cascade.queue_writes(top, [k for k in changed if k not in top.clean])
        if self._shared is not None:
            self._shared.publish(changed)

    def on_request_finished(self, req_context: ReqContext | None = None) -> None:
        return

    def on_schedule_end(self, context: Any = None) -> None:
        if self._results_waiting():
            self._jobs.drain()
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

    def new_keys(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys `prepare_store` would allocate in the first tier: those it does not hold."""
        return self._top.policy.absent(keys)

    def store_room(self) -> int | None:
        """How many new blocks the first tier can take now without evicting a block whose copy to
        the next tier has not been made (its free slots plus its clean blocks), when it cascades
        (`on_evict` or `on_store`); None when it does not (one tier, or cascade
        `none`: it evicts freely)."""
        top = self._top
        if top.below is None or top.cascade == "none":
            return None
        return top.backend.get_num_free_blocks() + len(top.clean)

    def clean_ahead(self, count: int) -> None:
        """Start copying the dirty blocks among the first tier's next `count` victims to the next
        tier now (`on_evict`; a caller about to wait for room, see `store_room`)."""
        self._cascade.clean_ahead(self._top, count)

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
        yield from self._log.take()

    def reset_cache(self) -> None:
        """Evict every unpinned, readable block from every tier."""
        self._jobs.drain()
        for tier in self.tiers:
            self._log.record(tier, tier.reset(), removed=True)

    def finish_reset(self, storing: Collection[OffloadKey], loading: Collection[OffloadKey]) -> list[OffloadKey]:
        """Finish a `reset_cache` that found engine jobs in flight, once the engine has flushed
        them (no transfer writes or reads their slots any more) and will never complete them.
        `storing`: keys of the engine's flushed stores (first tier, still being written): dropped,
        their slots freed. `loading`: keys of its flushed loads, once per `prepare_load` pin:
        unpinned, then dropped unless pinned again since (the reset evicts them now). Returns the
        keys dropped (reported as removed events)."""
        top = self._top
        for key in loading:
            block = top.policy.get(key)
            if block is not None and block.ref_cnt > 0:
                block.ref_cnt -= 1
        promoting = self._promotions.running
        storing = set(storing)
        dropped: list[OffloadKey] = []
        for key in storing.union(loading):
            block = top.policy.get(key)
            if block is None or key in promoting:
                continue
            if block.ref_cnt == 0 or (block.ref_cnt == -1 and key in storing):
                top.drop(key, block)
                dropped.append(key)
        self._log.record(top, dropped, removed=True)
        return dropped

    def get_stats(self) -> dict[str, Any]:
        """Per-tier counters and occupancy."""
        return {tier.name: tier.stats_row() for tier in self.tiers}

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every job the manager started has finished and been accounted, every
        write-through copy that can start has, and a shared tier's probes in flight answered
        (tests, bench, shutdown, the standalone API). With a `timeout` (seconds)
        raises `WaitTimeout`, naming the jobs still running, when they have not all finished by
        then (a hung handler); None waits as long as it takes."""
        self._quiescer.wait_idle(timeout)

    def shutdown(self, timeout: float | None = SHUTDOWN_TIMEOUT_S) -> None:
        """Wait up to `timeout` seconds for running copies, then shut the engine down and close the
        backends. Copies still running then are abandoned and logged: the engine (whose
        shutdown would wait for them) and the backends they use are left open, since a copy
        may still be writing into them; the other backends are closed."""
        self._quiescer.shutdown(timeout)
