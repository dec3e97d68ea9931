"""How blocks reach the next tier, and eviction that respects it.

- Either way a dirty block (no readable copy below) is never evicted to make room (`evict_for`):
  the copies of the next victims start first and only clean blocks go; too few is "no room yet".
  Only a block whose copy failed may go without one (`cascade_dropped_failed`).
- `on_evict`: when free + clean + being-demoted slots of a tier fall below its low watermark, the
  dirty blocks among its policy's next victims are copied to the next tier in the background
  (`refill_reserve`), so that the victims are clean when they are needed.
- `on_store` (write-through): every completed store is queued for a copy to the next tier
  (`queue_writes`); copies start up to the in-flight limit, the rest wait in the queue and are
  started every step and as jobs finish (`advance_writes`).
A copy is a `Demotion` job (`kvtier.control.jobs`): its source blocks stay pinned until it ends.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Collection
from itertools import filterfalse, islice

from kvtier.control.context import ControlContext
from kvtier.control.ended import evictable_first
from kvtier.control.jobs import Demotion, pin_sources
from kvtier.control.tier import Tier, enter_copies
from kvtier.core.keys import OffloadKey

log = logging.getLogger(__name__)


def split_below(tier: Tier, keys: list[OffloadKey]) -> list[OffloadKey]:
    """The `keys` of `tier` not resident in the next tier, in order (`absent`); those readable
    there are recorded as clean (those being written there are neither)."""
    below = tier.below
    assert below is not None
    absent = below.table.absent(keys)
    if len(absent) != len(keys):
        readable = below.readable
        tier.clean.update(k for k in set(keys).difference(absent) if readable(k) is not None)
    return absent


class Cascade:
    """The demotion controller of a chain of tiers: starts `Demotion` jobs and evicts for room."""

    def __init__(self, ctx: ControlContext):
        self._ctx = ctx
        self._jobs = ctx.jobs
        self._events = ctx.events
        self._retention = ctx.retention
        self._write_through = [t for t in ctx.tiers[:-1] if t.cascade == "on_store"]
        self._deferred = DeferredDemotions(len(ctx.tiers))

    # ------------------------------------------------------------------ eviction
    def evict_for(self, tier: Tier, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """Free enough slots of `tier` for `n` new blocks, keeping `protected`; the evicted keys,
        or None (nothing changed: no room yet). On a tier that cascades (`on_evict` or
        `on_store`), a block whose copy below is not readable is never evicted to make room: the
        copies of the dirty blocks among the next victims are started first (they land at once
        with handlers that finish at once: memory copies, replay), then only blocks safe to evict
        (`Tier.safe_to_evict`) are taken, in the policy's order; when too few are, the answer is
        None and the engine asks again once the copies landed.

        The blocks of sessions with a retention (`kvtier.control.retention`) are kept too, like
        pinned ones (each tier's table holds them: `BlockTable.hold`): no room yet while other
        blocks are pinned; only when the tier could not take `n` blocks even once every pin is
        released are they evicted as any other (`kept_past`). The blocks of ended sessions
        (`Tier.first_victims`) go before the policy's victims, even when the answer is None."""
        held = self._retention.held() if self._retention.sessions else ()  # (no hints: not asked)
        first = self._evict_first(tier, n, protected, held) if tier.first_victims else []
        evicted = self._evict_for(tier, n, protected)
        if evicted is None and held:
            evicted = self._evict_past(tier, n, protected, held)
        if first:
            return None if evicted is None else first + evicted
        return evicted

    def _evict_past(self, tier: Tier, n: int, protected: Collection[OffloadKey],
                    held: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """`evict_for` when the held blocks leave too little room: None while releasing every pin
        would make room without them (no room yet); otherwise evict in the policy's order, held
        blocks included, and hold again those that stay. O(retained): rare."""
        keep = set(protected).union(held)
        if room_without(tier, keep) >= n:
            return None
        table = tier.table
        resident = [k for k in held if table.get(k) is not None]
        table.hold(resident, False)
        try:
            evicted = self._evict_for(tier, n, protected)
        finally:
            table.hold(resident)  # (the evicted ones are not resident any more: skipped)
        if evicted and any(map(held.__contains__, evicted)):
            self._retention.stats.kept_past += 1
        return evicted

    def _evict_first(self, tier: Tier, n: int, keep: Collection[OffloadKey],
                     held: Collection[OffloadKey]) -> list[OffloadKey]:
        """Evict `tier`'s first victims (`evictable_first`) in order, up to the slots it lacks for
        `n` new blocks; a dirty one is copied down first and goes once its copy landed."""
        need = n - tier.backend.get_num_free_blocks()
        if need <= 0:
            return []
        first = evictable_first(tier, keep, held, need)
        if tier.below is not None and tier.cascade != "none":  # (else every block is safe to evict)
            safe = tier.safe_to_evict
            dirty = [k for k in first if not safe(k)]
            if dirty:
                self._copy_down(tier, dirty)
                self._jobs.drain()
                first = [k for k in evictable_first(tier, keep, held, need) if safe(k)]
        gone = tier.remove(first)
        tier.stats.evictions += len(gone)
        self._retention.stats.evicted_ended += len(gone)
        self._events.record(tier, gone, removed=True)
        return gone

    def _evict_for(self, tier: Tier, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        need = n - tier.backend.get_num_free_blocks()
        if need <= 0:
            return []
        if not isinstance(protected, set):
            protected = set(protected)
        if tier.below is not None and tier.cascade != "none":
            kept = self._keep_unsafe(tier, n, need, protected)
            if kept is None:
                return None
            if kept:
                protected = protected | kept
        return self.make_room(tier, n, protected)

    def _keep_unsafe(self, tier: Tier, n: int, need: int, protected: set[OffloadKey]) -> set[OffloadKey] | None:
        """`evict_for`'s care for a cascading tier: the blocks to protect too so that evicting
        `need` takes only blocks safe to evict (`unsafe_ahead`), after starting the copies of the
        dirty ones among the next `need` victims; None when there is no such room yet."""
        victims = tier.table.victims(need, protected)
        if len(victims) == need and tier.clean.issuperset(victims):
            return set()  # (the common case: the reserve kept the next victims clean)
        dirty = dirty_among(tier, victims)
        if dirty:
            self._copy_down(tier, dirty)
            self._jobs.drain()  # (jobs that ended may have freed slots: counted again)
        return unsafe_ahead(tier, n - tier.backend.get_num_free_blocks(), protected)

    def make_room(self, tier: Tier, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """`Tier.make_room`, recording the evictions as events."""
        evicted = tier.make_room(n, protected)
        if evicted and self._events.events is not None:
            self._events.record(tier, evicted, removed=True)
        return evicted

    def _copy_down(self, tier: Tier, keys: list[OffloadKey]) -> None:
        """Start the copies of `tier`'s dirty victims `keys` to the next tier, within the in-flight
        limits: an `on_evict` tier demotes them (`_demote`), a write-through tier moves them to
        the head of its queue and starts what it may (`advance_writes`)."""
        if tier.cascade != "on_store":
            self._demote(tier, keys)
            return
        queue = tier.unwritten
        for key in reversed(keys):
            queue[key] = None
            queue.move_to_end(key, last=False)
        self.advance_writes()

    # ------------------------------------------------------------------ on_evict
    def refill_reserve(self, tier: Tier) -> None:
        """Keep the next victims of an `on_evict` tier clean ahead of time: once the slots handed
        out since the last pass reach half the reserve, copy the dirty blocks among the next
        `reserve` victims to the next tier in the background (amortised: a pass walks `reserve`
        entries)."""
        if not tier.cascades_on_evict:
            return
        reserve = tier.reserve
        if tier.backend.get_num_free_blocks() >= reserve or tier.allocated_since_walk < reserve // 2:
            return
        tier.allocated_since_walk = 0
        dirty = dirty_among(tier, tier.table.victims(reserve))  # (retained blocks are held: never victims)
        if dirty:
            self._demote(tier, dirty)

    def _demote(self, tier: Tier, keys: list[OffloadKey]) -> None:
        """Copy readable blocks `keys` of `tier`, absent from the next tier (`dirty_among`),
        to the next tier (one job). Backpressure: what the in-flight limit does not allow is
        deferred (tried again on a later pass, or dropped at eviction), never awaited."""
        assert tier.below is not None
        room = tier.demotion_room(burst=len(keys))
        if len(keys) > room:
            self._deferred.note(tier, keys[max(0, room):])
            keys = keys[:max(0, room)]
        if keys and not self._start_demotion(tier, keys):
            log.debug("tier %s: no room to demote %d blocks", tier.below.name, len(keys))

    def _start_demotion(self, tier: Tier, keys: list[OffloadKey]) -> bool:
        """Pin readable blocks `keys` (distinct) of `tier` and start one `Demotion` to the next
        tier; False (nothing started) when the next tier has no room for them (`evict_for`: a
        next tier that cascades itself evicts only what it copied down)."""
        lower = tier.below
        assert lower is not None
        if self.evict_for(lower, len(keys), set(keys)) is None:  # (a cascading lower tier copies down first)
            return False
        src_ids = pin_sources(tier, keys)  # readable: checked by callers
        tier.demoting += len(keys)
        self._deferred.started(tier, keys)
        dst_ids = enter_copies(lower, keys)  # being written: pinned
        self._jobs.submit(Demotion(self._ctx, tier, lower, keys, src_ids, dst_ids))
        return True

    # ------------------------------------------------------------------ on demand (standalone API)
    def clean_ahead(self, tier: Tier, count: int) -> None:
        """Start one copy to the next tier of the dirty blocks among `tier`'s next `count` victims
        now, past the in-flight limit, for a caller that waits for it (the standalone `store`
        making room for its next round). An `on_evict` tier only."""
        if tier.cascades_on_evict and count > 0:
            dirty = dirty_among(tier, tier.table.victims(count))
            if dirty:
                self._start_demotion(tier, dirty)

    def dirty_keys(self, tier: Tier) -> list[OffloadKey]:
        """`tier`'s readable blocks without a readable copy in the next tier (those found readable
        there are recorded as clean), in the policy's order."""
        clean, readable = tier.clean, tier.readable
        keys = [k for k in list(tier.table.keys()) if k not in clean and readable(k) is not None]
        return split_below(tier, keys) if keys else []

    def flush_step(self, tier: Tier, limit: int, tried: set[OffloadKey]) -> int:
        """Start one copy of up to `limit` dirty blocks of `tier` not in `tried` (`flush`) to the
        next tier, adding them to `tried`; how many started (0: none left, or no room below)."""
        keys = [k for k in self.dirty_keys(tier) if k not in tried][:limit]
        tried.update(keys)
        if not keys or not self._start_demotion(tier, keys):
            return 0  # (a write-through queue keeps them: written once there is room below)
        tier.forget(keys)  # (out of a write-through queue: copied here)
        return len(keys)

    # ------------------------------------------------------------------ on_store (write-through)
    def queue_writes(self, tier: Tier, keys: list[OffloadKey]) -> None:
        """Queue copies of `tier`'s newly readable blocks `keys` to the next tier and start what
        the in-flight limit allows (all of them when nothing is in flight); the rest is counted
        as `cascade_deferred` and started later, oldest first (`advance_writes`)."""
        if not keys:
            return
        queue = tier.unwritten
        queue.update(dict.fromkeys(keys))
        self._pump_writes(tier, burst=len(keys))
        tier.stats.cascade_deferred += min(len(keys), len(queue))  # new keys are at the tail
        if queue and self._jobs.results_waiting():
            self.advance_writes()

    def advance_writes(self) -> None:
        """Start queued write-through copies until the in-flight limits stop them; copies that
        finish at once (memory tiers) are accounted right away and so make room for the next."""
        while self._write_through:
            started = False
            for tier in self._write_through:
                if tier.unwritten:
                    started |= self._pump_writes(tier)
            if not (started and self._jobs.results_waiting()):
                return
            self._jobs.drain()

    def writes_waiting(self) -> bool:
        """Whether a write-through queue waits for in-flight room (not for a full lower tier)."""
        return any(t.unwritten and not t.lower_full for t in self._write_through)

    def _pump_writes(self, tier: Tier, burst: int = 0) -> bool:
        """Start copies of the head of `tier`'s write-through queue, as many as its demotion room
        allows; whether any started. Keys gone from the tier, or already below, leave the queue.
        When the next tier has no room they stay at the head and `lower_full` is set."""
        assert tier.below is not None
        queue = tier.unwritten
        started = False
        while queue:
            room = tier.demotion_room(burst)
            if room <= 0:
                break
            keys = _take_head(tier, queue, room)
            if not keys:
                continue
            if not self._start_demotion(tier, keys):
                for key in reversed(keys):
                    queue[key] = None
                    queue.move_to_end(key, last=False)
                tier.lower_full = True
                break
            tier.lower_full = False
            started = True
        return started


class DeferredDemotions:
    """Per tier, the blocks whose demotion `Cascade._demote` deferred for in-flight room and whose
    copy has not started since: each is counted once in the tier's `cascade_deferred` however
    often the same victims are deferred again (every `refill_reserve` pass, every refused
    `prepare_store`), and again only after its copy started and it was deferred anew."""

    def __init__(self, tiers: int):
        self._keys: list[set[OffloadKey]] = [set() for _ in range(tiers)]

    def note(self, tier: Tier, keys: list[OffloadKey]) -> None:
        """`keys` (distinct) of `tier` wait for in-flight room: count those not waiting already.
        Keys that left the tier (or became clean) without a copy are forgotten once the set
        outgrows twice the tier's capacity (one pass over it: amortised O(1) per key)."""
        deferred = self._keys[tier.index]
        before = len(deferred)
        deferred.update(keys)
        tier.stats.cascade_deferred += len(deferred) - before
        if len(deferred) > 2 * tier.capacity:
            get, clean = tier.table.get, tier.clean
            self._keys[tier.index] = {k for k in deferred if k not in clean and get(k) is not None}

    def started(self, tier: Tier, keys: list[OffloadKey]) -> None:
        """The copies of `keys` of `tier` started: a later deferral of one counts again."""
        deferred = self._keys[tier.index]
        if deferred:
            deferred.difference_update(keys)


def dirty_among(tier: Tier, keys: list[OffloadKey]) -> list[OffloadKey]:
    """The `keys` of `tier` neither clean nor failed to copy that the next tier does not hold,
    in order; those found readable there become clean (`split_below`). C loops."""
    assert tier.below is not None
    clean, failed = tier.clean, tier.write_failed
    if clean:
        keys = list(filterfalse(clean.__contains__, keys))
    if failed:
        keys = list(filterfalse(failed.__contains__, keys))  # (may go: their copy failed)
    return split_below(tier, keys) if keys else keys


def room_without(tier: Tier, keep: set[OffloadKey]) -> int:
    """The blocks `tier` could take, once every pin is released, without evicting `keep`."""
    get = tier.table.get
    return tier.backend.get_num_free_blocks() + len(tier.table) - sum(1 for k in keep if get(k) is not None)


def unsafe_ahead(tier: Tier, need: int, protected: set[OffloadKey]) -> set[OffloadKey] | None:
    """The blocks of `tier` not safe to evict (`Tier.safe_to_evict`) that its policy would take
    before `need` safe ones: with them protected too, `evict(need, ...)` takes safe blocks only.
    None when fewer than `need` safe blocks are found before as many unsafe ones as two
    reserves and the write-through queue hold (no room yet: the copies started for the next
    victims make some; a walk past them would cost the whole tier when every block is dirty).
    A policy that does not predict its victims has every block not safe to evict protected
    (a walk of the tier)."""
    if need <= 0:
        return set()
    safe = tier.safe_to_evict
    if not tier.predicts_victims:
        return {k for k in tier.table.keys() if not safe(k)}
    skip: set[OffloadKey] = set()
    limit = need + 2 * tier.reserve + len(tier.unwritten)
    want = need
    while True:
        found = tier.table.victims(want, protected.union(skip) if skip else protected)
        ahead: list[OffloadKey] = []
        taken = 0
        for key in found:
            if safe(key):
                taken += 1
                if taken == need:
                    break
            else:
                ahead.append(key)
        if not ahead:
            return skip if taken == need else None
        before = len(skip)
        skip.update(ahead)
        if len(skip) >= limit or len(skip) == before:  # (the second: a policy naming protected keys)
            return None
        want = max(need, len(skip))


def _take_head(tier: Tier, queue: OrderedDict[OffloadKey, None], room: int) -> list[OffloadKey]:
    """Take keys from the head of `tier`'s write-through `queue` until `room` of them are readable
    in `tier` and absent from the next tier (returned, in order); the others leave the queue,
    those readable below recorded as clean (`split_below`). The common case (the first `room`
    keys all qualify) is one `readable_run` and one `absent`."""
    keys: list[OffloadKey] = []
    while queue and len(keys) < room:
        head = list(islice(queue, room - len(keys)))
        _consume(map(queue.pop, head), 0)
        if tier.table.readable_run(head) != len(head):
            head = [k for k in head if tier.readable(k) is not None]
        keys += split_below(tier, head) if head else head
    return keys
