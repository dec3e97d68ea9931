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
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, repeat
from operator import attrgetter
from typing import Any

from kvtier.engine import TransferEngine
from kvtier.interfaces import OffloadingManager
from kvtier.keys import OffloadKey
from kvtier.policies.base import CachePolicy
from kvtier.specs import CompositeLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvtier.tiers.base import Backend
from kvtier.types import (BlockStatus, LookupResult, OffloadingEvent, PrepareStoreOutput, ReqContext,
                          RequestOffloadingContext, TransferResult)

log = logging.getLogger("kvtier.manager")

_ref_cnt = attrgetter("ref_cnt")


def _all_writing(blocks: list[BlockStatus]) -> bool:
    """Whether every block is still being written (`ref_cnt == -1`), in C loops."""
    return list(map(_ref_cnt, blocks)).count(-1) == len(blocks)


CASCADE_MODES = ("on_evict", "on_store", "none")


@dataclass
class TierStats:
    """Counters of one tier since the start (or the last `reset`)."""

    hits: int = 0  # blocks loaded to the engine that this tier supplied (directly or by promotion)
    stores: int = 0  # blocks written into this tier (engine stores, demotions, promotions)
    evictions: int = 0
    demotions: int = 0  # blocks copied from this tier to the next one
    promotions: int = 0  # blocks copied from this tier up to tier 0
    cascade_dropped: int = 0  # dirty blocks evicted without a copy below
    cascade_dropped_failed: int = 0  # of those (write-through): their copy below failed
    cascade_dropped_full: int = 0  # of those (write-through): the next tier had no room or dropped its copy
    cascade_deferred: int = 0  # demotions not started at once because too many were in flight (backpressure)
    failures: int = 0  # failed jobs that wrote into this tier or read from it
    bytes_in: int = 0
    bytes_out: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Tier:
    """One backend at a position in the chain, with its policy and cascade mode."""

    name: str
    backend: Backend
    policy: CachePolicy
    cascade: str = "on_evict"  # how blocks reach the next tier (ignored on the last tier)
    reserve_fraction: float = 0.1  # low watermark of free-or-clean slots, as a fraction of capacity
    index: int = 0
    direct_load: bool = False  # a handler loads this tier straight into the engine's KV cache
    clean: set = field(default_factory=set)  # keys whose copy here is also readable in the next tier
    demoting: int = 0  # blocks of this tier pinned by running demotions
    allocated_since_walk: int = 0  # slots handed out since the last reserve pass
    # Write-through (`on_store`) state:
    unwritten: OrderedDict = field(default_factory=OrderedDict)  # readable keys whose copy below has not started, oldest first
    write_failed: set = field(default_factory=set)  # keys whose copy below failed (not tried again)
    lower_full: bool = False  # the last copy tried found no room in the next tier
    stats: TierStats = field(default_factory=TierStats)

    @property
    def capacity(self) -> int:
        return self.backend.num_blocks

    @property
    def medium(self) -> str:
        return self.backend.medium


@dataclass
class _Job:
    """A cascade or promotion job started by the manager."""

    kind: str  # "demote" or "promote"
    src: Tier
    dst: Tier
    keys: list[OffloadKey]
    src_blocks: list[BlockStatus]
    dst_blocks: list[BlockStatus]


class HierarchyManager(OffloadingManager):
    """`OffloadingManager` across a chain of tiers; byte movement goes through a `TransferEngine`."""

    def __init__(self, tiers: Sequence[Tier], engine: TransferEngine, enable_events: bool = False):
        if not tiers:
            raise ValueError("a hierarchy needs at least one tier")
        self.tiers: list[Tier] = list(tiers)
        self.engine = engine
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        for i, tier in enumerate(self.tiers):
            tier.index = i
            if tier.cascade not in CASCADE_MODES:
                raise ValueError(f"tier {tier.name!r}: cascade must be one of {CASCADE_MODES}, got {tier.cascade!r}")
            # Declared by the builder (its worker plane loads the tier), or routed by `engine` itself.
            tier.direct_load = i > 0 and (tier.direct_load or
                                          engine.handler_for(tier.backend.spec_type, GPULoadStoreSpec) is not None)
        self._top = self.tiers[0]
        self._write_through = [t for t in self.tiers[:-1] if t.cascade == "on_store"]
        self._jobs: dict[int, _Job] = {}
        self._promoting: dict[OffloadKey, int] = {}  # key -> source tier index (queued or running)
        self._promote_queue: dict[OffloadKey, None] = {}  # promotions to start at the end of the step
        self._promotion_refused: set[OffloadKey] = set()
        self._origin: dict[OffloadKey, int] = {}  # promoted key -> tier that supplied it
        self._pins: dict[OffloadKey, list[int]] = {}  # key -> tiers pinned by prepare_load
        self._recover()

    # ------------------------------------------------------------------ setup
    def _recover(self) -> None:
        """Adopt blocks that persistent backends found from an earlier process."""
        for tier in self.tiers:
            found = tier.backend.recover()
            for key, block in found:
                tier.policy.insert(key, block)
            if found:
                log.info("tier %s: recovered %d blocks", tier.name, len(found))
                self._event(tier, [k for k, _ in found], removed=False)
                if tier.index > 0:
                    above = self.tiers[tier.index - 1]
                    above.clean.update(k for k, _ in found if above.policy.get(k) is not None)

    # ------------------------------------------------------------------ protocol
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        if self.engine.finished:
            self._drain()
        block = self._top.policy.get(key)
        if block is not None and block.ref_cnt >= 0:
            return LookupResult.HIT
        if key in self._promoting:
            return LookupResult.RETRY
        if block is not None:
            return LookupResult.HIT_PENDING
        if key in self._promotion_refused:
            self._promotion_refused.discard(key)
            return LookupResult.MISS
        for tier in self.tiers[1:]:
            block = tier.policy.get(key)
            if block is None:
                continue
            if not block.is_ready:
                return LookupResult.HIT_PENDING
            if tier.direct_load:
                return LookupResult.HIT
            self._promoting[key] = tier.index
            self._promote_queue[key] = None
            return LookupResult.RETRY
        return LookupResult.MISS

    def load_source(self, key: OffloadKey) -> str | None:
        """Medium of the tier that supplies `key` to the engine: the tier a promotion into tier 0
        came from (until the block is loaded), else the first tier holding it readable."""
        origin = self._origin.get(key, self._promoting.get(key))
        if origin is not None:
            return self.tiers[origin].medium
        for tier in self.tiers:
            block = tier.policy.get(key)
            if block is not None and block.ref_cnt >= 0:
                return tier.medium
        return None

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> LoadStoreSpec:
        parts: dict[int, tuple[list[OffloadKey], list[BlockStatus], list[int]]] = {}
        for pos, key in enumerate(keys):
            for tier in self.tiers:
                block = tier.policy.get(key)
                if block is not None and block.ref_cnt >= 0 and (tier.index == 0 or tier.direct_load):
                    break
            else:
                raise KeyError(f"prepare_load: block {key.hex()} is not readable (lookup did not answer HIT)")
            block.ref_cnt += 1
            self._pins.setdefault(key, []).append(tier.index)
            origin = self._origin.pop(key, tier.index)
            self.tiers[origin].stats.hits += 1
            entry = parts.setdefault(tier.index, ([], [], []))
            entry[0].append(key)
            entry[1].append(block)
            entry[2].append(pos)
        specs = [(self.tiers[i].backend.get_load_store_spec(k, b), p) for i, (k, b, p) in sorted(parts.items())]
        if len(specs) == 1:
            return specs[0][0]
        if not specs:
            return self._top.backend.get_load_store_spec([], [])
        return CompositeLoadStoreSpec(specs)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        for tier in self.tiers:
            tier.policy.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        for key in keys:
            pinned = self._pins.get(key)
            if not pinned:
                raise KeyError(f"complete_load: block {key.hex()} was not prepared for loading")
            tier = self.tiers[pinned.pop()]
            if not pinned:
                del self._pins[key]
            tier.policy.get(key).ref_cnt -= 1

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> PrepareStoreOutput | None:
        self._drain()
        self._advance_writes()
        top = self._top
        to_store = list(filterfalse(top.policy.get, keys))  # not resident (a BlockStatus is truthy)
        if self._promote_queue:
            for key in to_store:
                if key in self._promote_queue:  # the engine's own bytes supersede a promotion not started yet
                    del self._promote_queue[key]
                    del self._promoting[key]
        evicted = self._evict_for(top, len(to_store), keys)
        if evicted is None:
            return None
        blocks = top.backend.allocate_blocks(to_store)
        # Tail first, so that the head of a prefix ends up the most recently used.
        top.policy.insert_many(to_store[::-1], blocks[::-1])
        top.allocated_since_walk += len(to_store)
        self._refill_reserve(top)
        return PrepareStoreOutput(to_store, top.backend.get_load_store_spec(to_store, blocks), evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None,
                       success: bool = True) -> None:
        top = self._top
        get = top.policy.get
        changed: list[OffloadKey] = []
        keys = keys if isinstance(keys, list) else list(keys)
        blocks = list(map(get, keys))
        if (success and not self._promoting and None not in blocks and _all_writing(blocks)
                and len(set(keys)) == len(keys)):
            # The common case (every key prepared by prepare_store once, none superseded): C loops.
            _consume(map(setattr, blocks, repeat("ref_cnt"), repeat(0)), 0)
            changed = list(keys)
        else:
            for key, block in zip(keys, blocks):
                if block is None or block.ref_cnt != -1 or key in self._promoting:
                    continue
                if success:
                    block.ref_cnt = 0
                else:
                    top.policy.remove(key)
                    top.backend.free(block)
                changed.append(key)
        if not success:
            top.stats.failures += 1 if changed else 0
            return
        top.stats.stores += len(changed)
        self._event(top, changed, removed=False)
        if len(self.tiers) > 1:
            below = self.tiers[1].policy.get
            top.clean.update(k for k in changed if (b := below(k)) is not None and b.ref_cnt >= 0)
            if top.cascade == "on_store":
                self._queue_writes(top, [k for k in changed if k not in top.clean])

    def on_request_finished(self, req_context: ReqContext | None = None) -> None:
        return

    def on_schedule_end(self, context: Any = None) -> None:
        self._drain()
        self._advance_writes()
        if self._promote_queue:
            self._flush_promotions()
        for tier in self.tiers[:-1]:
            self._refill_reserve(tier)

    def has_pending_work(self) -> bool:
        """Jobs in flight, promotions queued, or write-through copies waiting for in-flight room
        (not those waiting for room in a full lower tier: stepping an idle engine cannot free it)."""
        return bool(self._jobs) or bool(self._promote_queue) or self._writes_waiting()

    def new_keys(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys `prepare_store` would allocate in the first tier: those it does not hold."""
        return list(filterfalse(self._top.policy.get, keys))

    def store_room(self) -> int | None:
        """How many new blocks the first tier can take now without evicting a block whose copy to
        the next tier has not been made (its free slots plus its clean blocks), when it cascades
        on eviction; None when it does not (one tier, or cascade `none` / `on_store`)."""
        top = self._top
        if len(self.tiers) < 2 or top.cascade != "on_evict":
            return None
        return top.backend.get_num_free_blocks() + len(top.clean)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def reset_cache(self) -> None:
        """Evict every unpinned, readable block from every tier."""
        self._drain()
        for tier in self.tiers:
            victims = [(k, b) for k in list(tier.policy.keys()) if (b := tier.policy.get(k)).ref_cnt == 0]
            for key, block in victims:
                tier.policy.remove(key)
                tier.backend.free(block)
                tier.clean.discard(key)
                if tier.index > 0:
                    self.tiers[tier.index - 1].clean.discard(key)
            self._forget(tier, [k for k, _ in victims])
            self._event(tier, [k for k, _ in victims], removed=True)

    def get_stats(self) -> dict[str, Any]:
        """Per-tier counters and occupancy."""
        return {
            tier.name: {**tier.stats.as_dict(), "medium": tier.medium, "capacity_blocks": tier.capacity,
                        "resident_blocks": len(tier.policy), "free_blocks": tier.backend.get_num_free_blocks()}
            for tier in self.tiers
        }

    def wait_idle(self) -> None:
        """Block until every job the manager started has finished and been accounted, and every
        write-through copy that can start has (tests, bench)."""
        self._advance_writes()
        while self._jobs or self._promote_queue:
            if self._promote_queue:
                self._flush_promotions()
            self.engine.wait([j for j in self._jobs])
            self._drain()
            self._advance_writes()

    def shutdown(self) -> None:
        self.wait_idle()
        self.engine.shutdown()
        for tier in self.tiers:
            tier.backend.close()

    # ------------------------------------------------------------------ eviction and cascade
    def _evict_for(self, tier: Tier, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """`_make_room` after demoting the dirty blocks among the victims it is about to take.
        Handlers that finish at once (memory copies, replay) land before the eviction; slower ones
        were meant to be cleaned ahead of time by `_refill_reserve`: what is still dirty is
        dropped and counted. A write-through tier with copies waiting uses `_evict_written`."""
        need = n - tier.backend.get_num_free_blocks()
        if need <= 0:
            return []
        if not isinstance(protected, set):
            protected = set(protected)
        if self._cascades(tier):
            dirty = self._dirty_victims(tier, need, protected)
            if dirty:
                self._demote(tier, dirty)
                self._drain()
        elif tier.unwritten and not tier.lower_full:
            return self._evict_written(tier, n, need, protected)
        return self._make_room(tier, n, protected)

    def _evict_written(self, tier: Tier, n: int, need: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        """`_make_room` for a write-through tier whose next tier takes copies: blocks still queued
        for their copy are not victims. When the other blocks are too few, the queued copies of
        the next victims are started first and the answer is None (no room yet), unless they
        finish at once (memory tiers) or the next tier turns out to be full (then they may go)."""
        evicted = self._make_room(tier, n, protected.union(tier.unwritten))
        if evicted is not None:
            return evicted
        self._hurry_writes(tier, need, protected)
        return self._make_room(tier, n, protected if tier.lower_full else protected.union(tier.unwritten))

    def _make_room(self, tier: Tier, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """Free enough slots in `tier` for `n` new blocks; returns the evicted keys, or None."""
        need = n - tier.backend.get_num_free_blocks()
        if need <= 0:
            return []
        victims = tier.policy.evict(need, protected if isinstance(protected, set) else set(protected))
        if victims is None:
            return None
        if not victims:
            return []
        evicted_keys, blocks = zip(*victims)
        evicted = list(evicted_keys)
        tier.backend.free_many(blocks)
        clean = tier.clean
        if tier.index + 1 < len(self.tiers) and tier.cascade != "none":
            # evicted before a copy reached the next tier: lost to the hierarchy
            dropped = len(evicted) - len(clean.intersection(evicted))
            tier.stats.cascade_dropped += dropped
            if dropped and tier.cascade == "on_store":
                failed = len(tier.write_failed.intersection(evicted))
                tier.stats.cascade_dropped_failed += failed
                tier.stats.cascade_dropped_full += dropped - failed
        if clean:
            clean.difference_update(evicted)
        self._forget(tier, evicted)
        if tier.index > 0:
            self.tiers[tier.index - 1].clean.difference_update(evicted)
        elif self._origin:
            pop_origin = self._origin.pop
            for key in evicted:
                pop_origin(key, None)
        tier.stats.evictions += len(evicted)
        self._event(tier, evicted, removed=True)
        return evicted

    def _cascades(self, tier: Tier) -> bool:
        return tier.cascade == "on_evict" and tier.index + 1 < len(self.tiers)

    def _dirty_victims(self, tier: Tier, count: int, protected: Collection[OffloadKey]) -> list[OffloadKey]:
        """Among the next `count` victims of `tier`'s policy, those not yet readable in the next tier."""
        below = self.tiers[tier.index + 1].policy.get
        clean = tier.clean
        dirty: list[OffloadKey] = []
        seen = 0
        for key, _ in tier.policy.victim_candidates():
            if key in protected:
                continue
            if key not in clean:
                lower = below(key)
                if lower is not None and lower.ref_cnt >= 0:
                    clean.add(key)
                elif lower is None:
                    dirty.append(key)
            seen += 1
            if seen >= count:
                break
        return dirty

    def _refill_reserve(self, tier: Tier) -> None:
        """Keep the next victims of `tier` clean ahead of time: once the slots handed out since the
        last pass reach half the reserve, copy the dirty blocks among the next `reserve` victims
        to the next tier in the background (amortised: a pass walks `reserve` entries)."""
        if not self._cascades(tier):
            return
        reserve = max(1, int(tier.capacity * tier.reserve_fraction))
        if tier.backend.get_num_free_blocks() >= reserve or tier.allocated_since_walk < reserve // 2:
            return
        tier.allocated_since_walk = 0
        dirty = self._dirty_victims(tier, reserve, ())
        if dirty:
            self._demote(tier, dirty)

    def _demote(self, tier: Tier, keys: list[OffloadKey]) -> None:
        """Copy readable blocks of `tier` to the next tier (one job); they stay pinned until it ends."""
        lower = self.tiers[tier.index + 1]
        keys = [k for k in keys if lower.policy.get(k) is None]
        # Backpressure: the rest is deferred (tried again on a later pass, or dropped at
        # eviction), never awaited.
        room = self._demotion_room(tier, burst=len(keys))
        if len(keys) > room:
            tier.stats.cascade_deferred += len(keys) - max(0, room)
            keys = keys[:max(0, room)]
        if keys and not self._start_demotion(tier, keys):
            log.debug("tier %s: no room to demote %d blocks", lower.name, len(keys))

    def _demotion_room(self, tier: Tier, burst: int = 0) -> int:
        """How many more blocks of `tier` may start a demotion now. A slow lower tier gets at most
        two reserves' worth in flight; a burst of `burst` blocks may start when none is."""
        room = 2 * max(1, int(tier.capacity * tier.reserve_fraction)) - tier.demoting
        return max(room, burst) if tier.demoting == 0 else room

    def _start_demotion(self, tier: Tier, keys: list[OffloadKey]) -> bool:
        """Pin readable blocks `keys` of `tier` and start one job copying them to the next tier;
        False (nothing started) when the next tier has no room for them. A next tier that
        writes through itself gives up its written blocks first."""
        lower = self.tiers[tier.index + 1]
        protected = set(keys)
        if lower.unwritten and not lower.lower_full:
            evicted = self._make_room(lower, len(keys), protected.union(lower.unwritten))
        else:
            evicted = None
        if evicted is None and self._make_room(lower, len(keys), protected) is None:
            return False
        src_blocks = [tier.policy.get(k) for k in keys]
        for block in src_blocks:
            block.ref_cnt += 1
        tier.demoting += len(keys)
        dst_blocks = lower.backend.allocate_blocks(keys)
        lower.policy.insert_many(keys, dst_blocks)
        self._submit(_Job("demote", tier, lower, keys, src_blocks, dst_blocks))
        return True

    # ------------------------------------------------------------------ write-through (on_store)
    def _queue_writes(self, tier: Tier, keys: list[OffloadKey]) -> None:
        """Queue copies of `tier`'s newly readable blocks `keys` to the next tier and start what
        the in-flight limit allows (all of them when nothing is in flight); the rest is counted
        as `cascade_deferred` and started later, oldest first (`_advance_writes`)."""
        if not keys:
            return
        queue = tier.unwritten
        queue.update(dict.fromkeys(keys))
        self._pump_writes(tier, burst=len(keys))
        tier.stats.cascade_deferred += min(len(keys), len(queue))  # new keys are at the tail
        if queue and self.engine.finished:
            self._advance_writes()

    def _advance_writes(self) -> None:
        """Start queued write-through copies until the in-flight limits stop them; copies that
        finish at once (memory tiers) are accounted right away and so make room for the next."""
        while self._write_through:
            started = False
            for tier in self._write_through:
                if tier.unwritten:
                    started |= self._pump_writes(tier)
            if not (started and self.engine.finished):
                return
            self._drain()

    def _pump_writes(self, tier: Tier, burst: int = 0) -> bool:
        """Start copies of the head of `tier`'s write-through queue, as many as `_demotion_room`
        allows; whether any started. Keys gone from the tier, or already below, leave the queue.
        When the next tier has no room they stay at the head and `lower_full` is set."""
        queue = tier.unwritten
        lower_get = self.tiers[tier.index + 1].policy.get
        get = tier.policy.get
        started = False
        while queue:
            room = self._demotion_room(tier, burst)
            if room <= 0:
                break
            keys: list[OffloadKey] = []
            while queue and len(keys) < room:
                key = queue.popitem(last=False)[0]
                block, below = get(key), lower_get(key)
                if block is None or block.ref_cnt < 0:
                    continue
                if below is not None:
                    if below.ref_cnt >= 0:
                        tier.clean.add(key)
                    continue
                keys.append(key)
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

    def _hurry_writes(self, tier: Tier, need: int, protected: Collection[OffloadKey]) -> None:
        """Move the queued keys among `tier`'s next `need` victims to the head of its write-through
        queue and start what the in-flight limit allows (the rest goes first when room frees)."""
        queue = tier.unwritten
        hurried: list[OffloadKey] = []
        seen = 0
        for key, _ in tier.policy.victim_candidates():
            if key in protected:
                continue
            if key in queue:
                hurried.append(key)
            seen += 1
            if seen >= need:
                break
        for key in reversed(hurried):
            queue.move_to_end(key, last=False)
        self._advance_writes()

    def _writes_waiting(self) -> bool:
        """Whether a write-through queue waits for in-flight room (not for a full lower tier)."""
        return any(t.unwritten and not t.lower_full for t in self._write_through)

    def _forget(self, tier: Tier, keys: Collection[OffloadKey]) -> None:
        """Drop write-through state of keys that left `tier`."""
        if tier.unwritten:
            pop = tier.unwritten.pop
            for key in keys:
                pop(key, None)
        if tier.write_failed:
            tier.write_failed.difference_update(keys)

    def _flush_promotions(self) -> None:
        """Start the promotions queued by `lookup`, one job per source tier. Source blocks are
        pinned first: making room in tier 0 may demote into (and so evict from) their tier."""
        queue, self._promote_queue = self._promote_queue, {}
        top = self._top
        by_tier: dict[int, tuple[list[OffloadKey], list[BlockStatus]]] = {}
        for key in queue:
            src = self.tiers[self._promoting[key]]
            block = src.policy.get(key)
            if block is None or block.ref_cnt < 0 or top.policy.get(key) is not None:
                self._refuse_promotion(key)
                continue
            block.ref_cnt += 1  # held until the job ends (`_finish` releases it)
            entry = by_tier.setdefault(src.index, ([], []))
            entry[0].append(key)
            entry[1].append(block)
        for index, (keys, src_blocks) in by_tier.items():
            if self._evict_for(top, len(keys), set(keys)) is None:
                for key, block in zip(keys, src_blocks):
                    block.ref_cnt -= 1
                    self._refuse_promotion(key)
                continue
            dst_blocks = top.backend.allocate_blocks(keys)
            top.policy.insert_many(keys, dst_blocks)
            top.allocated_since_walk += len(keys)
            self._submit(_Job("promote", self.tiers[index], top, keys, src_blocks, dst_blocks))

    def _refuse_promotion(self, key: OffloadKey) -> None:
        del self._promoting[key]
        self._promotion_refused.add(key)

    def _submit(self, job: _Job) -> None:
        src_spec = job.src.backend.get_load_store_spec(job.keys, job.src_blocks)
        dst_spec = job.dst.backend.get_load_store_spec(job.keys, job.dst_blocks)
        job_id = self.engine.new_job_id()
        self._jobs[job_id] = job
        self.engine.submit(src_spec, dst_spec, job_id)

    def _drain(self) -> None:
        """Account for every finished job."""
        for result in self.engine.poll():
            job = self._jobs.pop(result.job_id, None)
            if job is not None:
                self._finish(job, result)

    def _finish(self, job: _Job, result: TransferResult) -> None:
        src, dst = job.src, job.dst
        for block in job.src_blocks:
            block.ref_cnt -= 1
        if job.kind == "demote":
            src.demoting -= len(job.keys)
        ok = result.success
        if ok:
            for block in job.dst_blocks:
                block.ref_cnt = 0
            src.stats.bytes_out += result.transfer_size or 0
            src.stats.seconds_out += result.transfer_time or 0.0
            dst.stats.bytes_in += result.transfer_size or 0
            dst.stats.seconds_in += result.transfer_time or 0.0
            dst.stats.stores += len(job.keys)
            self._event(dst, job.keys, removed=False)
        else:
            src.stats.failures += 1
            dst.stats.failures += 1
            for key, block in zip(job.keys, job.dst_blocks):
                dst.policy.remove(key)
                dst.backend.free(block)
        if job.kind == "demote":
            if ok:
                src.stats.demotions += len(job.keys)
                src.clean.update(job.keys)
                if dst.cascade == "on_store" and dst.index + 1 < len(self.tiers):
                    dst.unwritten.update(dict.fromkeys(job.keys))  # started by `_advance_writes`
            elif src.cascade == "on_store":
                src.write_failed.update(k for k in job.keys if src.policy.get(k) is not None)
        else:
            for key in job.keys:
                self._promoting.pop(key, None)
            if ok:
                src.stats.promotions += len(job.keys)
                if src.index == 1:
                    dst.clean.update(job.keys)
                for key in job.keys:
                    self._origin[key] = src.index
            else:
                # A block that could not be read back is not trusted again, unless its backend
                # verified it (a job fails as a whole when one of its blocks is bad).
                for key, block in zip(job.keys, job.src_blocks):
                    if block.ref_cnt == 0 and src.policy.get(key) is block and not src.backend.still_valid(block):
                        src.policy.remove(key)
                        src.backend.free(block)
                        if src.index > 0:
                            self.tiers[src.index - 1].clean.discard(key)
                        self._forget(src, [key])
                        self._event(src, [key], removed=True)
                    self._promotion_refused.add(key)

    def _event(self, tier: Tier, keys: list[OffloadKey], removed: bool) -> None:
        if keys and self.events is not None:
            self.events.append(OffloadingEvent(list(keys), tier.backend.block_size, tier.medium, removed, tier.name))
