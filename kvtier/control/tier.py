"""`Tier`: one backend in the chain, its policy, and every piece of state the manager keeps for it;
`enter_copies`: how blocks enter a tier (being written)."""

from __future__ import annotations

from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from kvtier.core.errors import PolicyError
from kvtier.core.keys import OffloadKey
from kvtier.core.types import DEFAULT_CASCADE, DEFAULT_RESERVE, BlockStatus
from kvtier.index import BlockTable, table_of
from kvtier.policies.base import CachePolicy, predicts_victims
from kvtier.tiers.base import Backend

# The `ref_cnt`s of blocks `Tier.remove` may take (a pinned block, > 0, never leaves).
IDLE = frozenset({0})  # readable, unpinned
WRITING = frozenset({-1})  # being written
UNPINNED = IDLE | WRITING


@dataclass
class TierStats:
    """Counters of one tier since the start (or the last `reset`)."""

    # blocks loaded to the engine that this tier supplied (directly or by promotion), counted as the
    # load completes: never a block whose load failed (`LoadPins.complete`)
    hits: int = 0
    stores: int = 0  # blocks written into this tier (engine stores, demotions, promotions)
    evictions: int = 0
    demotions: int = 0  # blocks copied from this tier to the next one
    promotions: int = 0  # blocks copied from this tier up to tier 0
    cascade_dropped: int = 0  # dirty blocks evicted without a copy below
    cascade_dropped_failed: int = 0  # of those: their copy below failed (the only ones `Cascade.evict_for` lets go)
    cascade_dropped_full: int = 0  # of those: any other (a policy evicting past its own victims); 0 otherwise
    # blocks whose copy below did not start at once because too many were in flight (backpressure),
    # each once until its copy starts (`cascade.DeferredDemotions`)
    cascade_deferred: int = 0
    failures: int = 0  # blocks that failed a transfer: read from this tier (once each) or written into it
    # A shared tier (kvtier.control.shared_probes); zero elsewhere:
    publish_dropped: int = 0  # blocks not published: in-flight bound, slow writes, server down, no handle room
    probes: int = 0  # probe batches sent (at most one per scheduler step)
    probe_keys: int = 0  # keys in those batches
    probe_hits: int = 0  # keys a probe found
    probe_failures: int = 0  # batches that failed (their keys answered MISS)
    probe_timeouts: int = 0  # keys whose probe did not answer in time (answered MISS)
    breaker_misses: int = 0  # lookups answered MISS at once because the server was considered down
    rejected: int = 0  # blocks a promotion from this tier could not read (gone, failed verification, unreachable)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Tier:
    """One backend at a position in the chain, with its policy, cascade mode and state.

    The constructor takes the configuration (name, backend, policy, cascade, reserve_fraction);
    `HierarchyManager` sets the position (`index`, `above`, `below`, `direct_load`) and owns the
    rest, which records, per block of this tier:
    - residency: the block table (`table.get(key)`, the block's `ref_cnt`: -1 while being written,
      > 0 while pinned by loads or copies), its one writer; the policy only orders (kvtier.index);
    - `clean`: keys whose copy here is also readable in the next tier (evicting it loses nothing);
    - `write_failed`: keys whose copy below failed (they may be evicted without one, counted);
    - write-through (`on_store`): `unwritten`, readable keys whose copy below has not started
      (oldest first), and `lower_full`;
    - `promoted_from` (tier 0): keys promoted into this tier -> index of the tier that supplied
      them, until they are loaded or evicted (so the supplier is credited with the hit);
    - `first_victims`: blocks of ended sessions (`kvtier.control.retention`), evicted before the
      policy's victims, in order (`Cascade.evict_for`), until they leave or are used again.
    """

    name: str
    backend: Backend
    policy: CachePolicy
    cascade: str = DEFAULT_CASCADE  # how blocks reach the next tier (ignored on the last tier)
    reserve_fraction: float = DEFAULT_RESERVE  # low watermark of free-or-clean slots, as a fraction of capacity
    index: int = 0
    direct_load: bool = False  # a handler loads this tier straight into the engine's KV cache
    above: Tier | None = field(default=None, init=False, repr=False, compare=False)
    below: Tier | None = field(default=None, init=False, repr=False, compare=False)
    clean: set[OffloadKey] = field(default_factory=set, init=False)
    demoting: int = field(default=0, init=False)  # blocks of this tier pinned by running demotions
    allocated_since_walk: int = field(default=0, init=False)  # slots handed out since the last reserve pass
    unwritten: OrderedDict[OffloadKey, None] = field(default_factory=OrderedDict, init=False)
    write_failed: set[OffloadKey] = field(default_factory=set, init=False)
    lower_full: bool = field(default=False, init=False)  # the last copy tried found no room below
    promoted_from: dict[OffloadKey, int] = field(default_factory=dict, init=False, repr=False)
    condemned: set[OffloadKey] = field(default_factory=set, init=False)  # failed a read, still pinned: see `condemn`
    first_victims: OrderedDict[OffloadKey, None] = field(default_factory=OrderedDict, init=False, repr=False)
    # the keys sessions retain (`Retention.retained`, the same for every tier): held in the table on
    # entry (`hold_entering`)
    retained: Mapping[OffloadKey, str] = field(default_factory=dict, init=False, repr=False)
    # where retained keys that leave this tier are reported (`Retention.left`, the same list for every tier)
    retained_left: list[OffloadKey] = field(default_factory=list, init=False, repr=False)
    stats: TierStats = field(default_factory=TierStats, init=False)
    # key -> slot, block state and load pins, behind one batch API over slot ids (kvtier.index)
    table: BlockTable = field(init=False, repr=False, compare=False)
    predicts_victims: bool = field(init=False, repr=False, compare=False)  # the policy names victims ahead

    def __post_init__(self) -> None:
        self.table = table_of(self.policy)
        self.predicts_victims = predicts_victims(self.policy)

    @property
    def capacity(self) -> int:
        return self.backend.num_blocks

    @property
    def medium(self) -> str:
        return self.backend.medium

    @property
    def reserve(self) -> int:
        """The low watermark in blocks (at least one)."""
        return max(1, int(self.capacity * self.reserve_fraction))

    @property
    def cascades_on_evict(self) -> bool:
        return self.cascade == "on_evict" and self.below is not None

    @property
    def writes_through(self) -> bool:
        return self.cascade == "on_store" and self.below is not None

    def readable(self, key: OffloadKey) -> BlockStatus | None:
        """The block of `key` if it is resident, written (not being written) and not condemned, else None."""
        block = self.table.get(key)
        if block is None or block.ref_cnt < 0 or (self.condemned and key in self.condemned):
            return None
        return block

    def condemn(self, keys: Iterable[OffloadKey]) -> None:
        """The blocks `keys` of this tier failed a read (a job or an engine load read them and
        still pins each: they are the blocks that failed). Each is counted once in `failures`,
        answered as absent from now on (`readable`, the manager's lookups) and removed when its
        last pin is released (`release_loads`)."""
        get, condemned = self.table.get, self.condemned
        new = [k for k in dict.fromkeys(keys) if k not in condemned and get(k) is not None]
        condemned.update(new)
        self.stats.failures += len(new)

    def release_loads(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Release one read pin of each of `keys` (`BlockTable.release_loads`); the condemned ones
        left unpinned are removed: returns those (for the caller's removal events)."""
        self.table.release_loads(keys)
        if not self.condemned:
            return []
        return self.remove([k for k in keys if k in self.condemned])

    def demotion_room(self, burst: int = 0) -> int:
        """How many more blocks may start a demotion now. A slow lower tier gets at most two
        reserves' worth in flight; a burst of `burst` blocks may start when none is."""
        room = 2 * self.reserve - self.demoting
        return max(room, burst) if self.demoting == 0 else room

    def safe_to_evict(self, key: OffloadKey) -> bool:
        """Whether evicting `key` loses nothing the hierarchy promised to keep: always on a tier
        that does not cascade; on one that does, when its copy below is readable (`clean`) or
        could not be made (`write_failed`: counted as `cascade_dropped_failed` when it goes)."""
        return self.below is None or self.cascade == "none" or key in self.clean or key in self.write_failed

    def make_room(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """Free enough slots for `n` new blocks; returns the evicted keys, or None (nothing
        changed) when the policy cannot find enough unpinned, unprotected victims."""
        need = n - self.backend.get_num_free_blocks()
        if need <= 0:
            return []
        return self.evict(need, protected if isinstance(protected, set) else set(protected))

    def evict(self, need: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        """Evict `need` (> 0) blocks that are not pinned or `protected`; the evicted keys, or None
        (nothing changed) when the policy cannot find that many (`make_room` without the count
        of free slots). The policy chooses; `Cascade.evict_for` protects what must not go. On a
        tier that cascades, the evicted blocks' copies below become as recent there as a copy
        made now, in eviction order, so the tier below drops them after the copies of blocks
        still held above, and a chain's deep end before its head."""
        try:
            got = self.table.evict_ids(need, protected)  # (keys and slot ids: no block objects)
        except PolicyError as exc:  # (a user's policy broke its contract: the table freed nothing)
            raise PolicyError(f"tiers[{self.index}] ({self.name}): {exc}") from None
        if got is None:
            return None
        evicted, ids = got
        if not evicted:
            return []
        copied: list[OffloadKey] = []
        below = self.below if self.cascade != "none" else None
        if below is not None:
            self._count_dropped(evicted)
            # (copies made before the blocks left: a refilled reserve, write-through; `touch` makes
            # its first key the most recent: the last victim, nearest its chain's head)
            clean = self.clean
            copied = [k for k in reversed(evicted) if k in clean]
        self._left(evicted, ids)
        self.stats.evictions += len(evicted)
        if below is not None and copied:  # (last: a policy below that raises leaves this tier consistent)
            below.table.touch(copied)
        return evicted

    def _count_dropped(self, evicted: list[OffloadKey]) -> None:
        """Count the evicted blocks that had no copy below (lost to the hierarchy): those whose
        copy failed (`cascade_dropped_failed`), and any other (`cascade_dropped_full`, which
        `Cascade.evict_for` keeps at 0); a tier that cascades (`below` set, cascade not `none`)."""
        dropped = len(evicted) - len(self.clean.intersection(evicted))
        if dropped:
            failed = len(self.write_failed.intersection(evicted))
            self.stats.cascade_dropped += dropped
            self.stats.cascade_dropped_failed += failed
            self.stats.cascade_dropped_full += dropped - failed

    def remove(self, keys: Iterable[OffloadKey], states: frozenset[int] = IDLE,
               slots: Iterable[int] | None = None) -> list[OffloadKey]:
        """The one way a block leaves this tier other than by eviction (`evict`): a failed write,
        a block that failed verification, a cache reset, a flushed store. Removes each of `keys`
        that is resident, whose `ref_cnt` is one of `states` (`IDLE`: readable and unpinned;
        `WRITING`: being written; `UNPINNED`: either) and, when `slots` is given (one per key),
        that still sits in that slot; frees its slot and forgets every piece of state kept for it
        (here and in the tier above). Pinned blocks never leave. Returns the keys removed."""
        get = self.table.get
        gone: list[OffloadKey] = []
        ids: list[int] = []
        wanted = zip(keys, slots) if slots is not None else zip(keys, repeat(None))
        for key, slot in dict(wanted).items():
            block = get(key)
            if block is None or block.ref_cnt not in states or (slot is not None and block.block_id != slot):
                continue
            gone.append(key)
            ids.append(block.block_id)
        if gone:
            self.table.forget(gone)
            self._left(gone, ids)
        return gone

    def _left(self, keys: list[OffloadKey], ids: list[int]) -> None:
        """Blocks `keys` (in slots `ids`) left the table: free the slots and forget their state."""
        self.backend.free_block_ids(ids)
        if self.retained:
            left = self.retained.keys() & keys
            if left:  # (the retention forgets those that left every tier: `Retention._settle`)
                self.retained_left.extend(left)
        if self.clean:
            self.clean.difference_update(keys)
        if self.condemned:
            self.condemned.difference_update(keys)
        if self.first_victims:
            for key in keys:
                self.first_victims.pop(key, None)
        if self.unwritten or self.write_failed:
            self.forget(keys)
        if self.above is not None:
            self.above.clean.difference_update(keys)
        elif self.promoted_from:
            _consume(map(self.promoted_from.pop, keys, repeat(None)), 0)

    def forget(self, keys: Collection[OffloadKey]) -> None:
        """Drop the write-through state of keys that left this tier (or were copied below)."""
        if self.unwritten:
            pop = self.unwritten.pop
            for key in keys:
                pop(key, None)
        if self.write_failed:
            self.write_failed.difference_update(keys)

    def stats_row(self) -> dict[str, Any]:
        """This tier's counters and occupancy (one entry of `get_stats`)."""
        return {**self.stats.as_dict(), "medium": self.medium, "capacity_blocks": self.capacity,
                "resident_blocks": len(self.table), "free_blocks": self.backend.get_num_free_blocks()}


def enter_copies(tier: Tier, keys: list[OffloadKey], tail_first: bool = False) -> list[int]:
    """Allocate slots of `tier` for `keys` (distinct, absent there; the caller made room), in
    their order, and insert them being written (`ref_cnt == -1`, pinned) through the table's
    `insert_written`; their slot ids. With `tail_first` (a request's new blocks) they are
    inserted last key first, the last one named as the request's tail (the
    `CachePolicy.insert_many` contract); copies between tiers have no tail. Retained keys are
    held there (`hold_entering`).

    Atomic under a policy error: when inserting or pinning raises (a third-party policy refusing
    a key), the keys already inserted are removed, the slots freed, and the error propagates."""
    step, tail = (-1, keys[-1] if keys else None) if tail_first else (1, None)
    ids = tier.backend.allocate_block_ids(keys)
    try:
        tier.table.insert_written(keys[::step], ids[::step], tail=tail)
        if tier.retained:  # (hints: a session retains some of them)
            hold_entering(tier, keys)
    except BaseException:
        # (the keys a failed insert left resident leave as a failed write does, slots freed)
        removed = set(tier.remove(keys, WRITING, ids))
        tier.backend.free_block_ids([i for k, i in zip(keys, ids) if k not in removed])
        raise
    return ids


def hold_entering(tier: Tier, keys: Iterable[OffloadKey]) -> None:
    """Blocks `keys` entered `tier`: hold the retained ones (`Tier.retained`) there, as the
    retention held them in the tiers they were in when it started (`kvtier.control.ended.hold`)."""
    retained = tier.retained
    tier.table.hold([k for k in keys if k in retained])
