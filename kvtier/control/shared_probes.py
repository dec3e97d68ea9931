"""`SharedTierProbes`, the shared tier's controller: publish on store, find before compute, failure is a miss.

A shared tier (`Backend.shared`: a `RemoteBlocks` backend such as `ValkeyBackend`) comes after
every local tier and is not in the cascade chain. Its policy holds *handles*: keys this process
knows are on the server (published, or found by a probe); evicting one forgets it locally.

- **Publish.** When the first tier's stores complete, the keys without a handle are copied
  CPU -> REMOTE (`Publish` jobs, first-tier blocks pinned meanwhile, split over the backend's
  threads), a handle allocated for each (being written: a key is never sent twice at once). Over
  `max_inflight_bytes`, while the breaker is open, after a slow or failed write (a full
  server: paused for `breaker_open_s`), or without room for handles, the blocks are not sent:
  dropped and counted (`publish_dropped`), never waited on; the handles of blocks a job could not
  write are dropped. The dedupe is not permanent: a block stored again whose handle is stale
  (older than `HANDLE_TTL_S`, or than the last read that found a key gone: the server may have
  restarted or been flushed) is published again.
- **Lookup** of a key no tier holds (`lookup`): a negative answer still fresh, or the breaker
  open -> MISS at once; a probe in flight -> RETRY until its deadline (the store's timeout after
  it was sent, one step after the lookup), then MISS; else the key joins the pending set -> RETRY.
- **Step** (`step`, each `on_schedule_end`): the answers of finished probes are taken (a key
  found gets a handle and a promotion into the first tier; a key absent, or whose probe failed,
  is negative-cached for `negative_ttl_s`), failed reads are negative-cached, and every pending
  key goes to the backend's probe thread in ONE batch. Nothing here touches a socket. With
  `negative_ttl_s: 0` a negative answer is given once, to the next lookup of the key (the one
  waiting on the probe), and not cached beyond it. Keys found when the tier has no room for
  their handles: the longest prefix that fits is adopted, the rest answer MISS once.
- **Reads that fail** (value gone, failing verification, server unreachable) fail the promotion:
  the handles the read named are dropped (`Job.finish`: condemned), the next lookup answers MISS.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from time import monotonic, sleep
from typing import Any, cast

from kvtier.control.context import ControlContext
from kvtier.control.jobs import Job, pin_sources
from kvtier.control.promotion import Promotions, longest_fit
from kvtier.control.tier import Tier, enter_copies, hold_entering
from kvtier.core.keys import OffloadKey
from kvtier.core.types import LookupResult

MAX_PENDING = 4096  # keys waiting for a probe; past this, lookups of new keys answer MISS
MAX_NEGATIVE = 1 << 16  # negative answers kept (the oldest are forgotten first)
ONCE = -1.0  # the expiry of a negative answer given to the next lookup only (then forgotten)


def local_tiers(tiers: Sequence[Tier]) -> int:
    """How many tiers are local (the shared one, if any, is last); ValueError for a shared tier
    that is not last, a second one, or a first tier that is not in host memory."""
    shared = [i for i, t in enumerate(tiers) if getattr(t.backend, "shared", False)]
    if not shared:
        return len(tiers)
    if shared != [len(tiers) - 1] or len(tiers) < 2:
        raise ValueError(f"a shared tier must be the last of at least two, and there may be one: shared tiers at "
                         f"{shared} of {len(tiers)}")
    if tiers[0].medium != "CPU":
        raise ValueError(f"with a shared tier the first tier must be in host memory (CPU), got {tiers[0].medium}")
    return len(tiers) - 1


class Publish(Job):
    """A copy of readable first-tier blocks to the shared tier (handles being written)."""

    kind = "publish"

    def __init__(self, shared: SharedTierProbes, keys: list[OffloadKey], src_ids: list[int], dst_ids: list[int]):
        super().__init__(shared.ctx, shared.top, shared.tier, keys, src_ids, dst_ids)
        self.shared = shared
        self.nbytes = len(keys) * shared.backend.block_bytes

    def not_taken(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The keys whose writes were left unsent (writes paused or failed: server full, down, slow,
        past the job's deadline), counted in `publish_dropped`: `Job.finish` drops their handles
        before any is readable, so they are never counted as stores nor reported stored."""
        unsent = cast("list[OffloadKey]", self.shared.backend.take_unsent(keys))
        self.dst.stats.publish_dropped += len(unsent)
        return unsent

    def landed(self, keys: list[OffloadKey]) -> None:
        absent = self.shared.absent
        if absent:  # (written: the server has them now)
            for key in keys:
                absent.pop(key, None)

    def failed(self, keys: list[OffloadKey]) -> None:
        self.shared.backend.take_unsent(keys)  # (forget any left unsent: a later job of them starts afresh)

    def ended(self) -> None:
        self.shared.inflight_bytes -= self.nbytes


MakeRoom = Callable[[Tier, int, Collection[OffloadKey]], "list[OffloadKey] | None"]


class SharedTierProbes:
    """The controller of the hierarchy's shared tier (the module docstring says what it does):
    the last of `ctx.tiers`. Keys it finds are promoted through `promotions`; room for handles is
    made by `make_room` (`Cascade.make_room`: evictions recorded as events)."""

    def __init__(self, ctx: ControlContext, promotions: Promotions, make_room: MakeRoom):
        self.ctx = ctx
        self.tier = ctx.tiers[-1]
        self.top = ctx.top
        self.backend: Any = self.tier.backend  # a RemoteBlocks
        self.local = ctx.tiers[:-1]
        self._jobs, self._events = ctx.jobs, ctx.events
        self._promotions, self._make_room = promotions, make_room
        self.pending: dict[OffloadKey, None] = {}  # keys to probe at the end of this step
        self.probing: dict[OffloadKey, float] = {}  # key -> deadline of its probe in flight
        self._batches: deque[tuple[float, list[OffloadKey]]] = deque()  # (deadline, keys) in send order
        self.absent: OrderedDict[OffloadKey, float] = OrderedDict()  # key -> expiry of "not there"
        self.inflight_bytes = 0

    # ------------------------------------------------------------------ lookup
    def lookup(self, key: OffloadKey) -> LookupResult:
        """The answer for a key that no local tier holds and that has no handle."""
        self._absorb()
        if self.tier.table.get(key) is not None or key in self._promotions.running:
            return LookupResult.RETRY  # found by a probe just taken: its promotion is queued
        now = monotonic()
        deadline = self.probing.get(key)
        if deadline is not None:
            return LookupResult.RETRY if now < deadline else LookupResult.MISS
        expiry = self.absent.get(key)
        if expiry is not None:
            if expiry == ONCE or now >= expiry:
                del self.absent[key]
            if expiry == ONCE or now < expiry:
                return LookupResult.MISS
        if key in self.pending:
            return LookupResult.RETRY
        if not self.backend.available:
            self.tier.stats.breaker_misses += 1
            return LookupResult.MISS
        if len(self.pending) >= MAX_PENDING:
            return LookupResult.MISS
        self.pending[key] = None
        return LookupResult.RETRY

    def prefetch(self, keys: Sequence[OffloadKey]) -> None:
        """For the keys after a RETRY in a run (the rest of a request's prefix): promote those
        with a readable handle, and probe, with this step's batch, those no tier holds, so that
        the run comes up together instead of one block per lookup."""
        if not self.backend.available:
            return
        local = [t.table.get for t in self.local]
        handle = self.tier.readable
        running, refused = self._promotions.running, self._promotions.refused
        room = MAX_PENDING - len(self.pending)
        for key in keys[:room]:
            if key in self.pending or key in self.probing or key in running or key in refused:
                continue
            if any(get(key) is not None for get in local):
                continue
            if handle(key) is not None:
                self._promotions.request(key, self.tier)
            elif key not in self.absent:
                self.pending[key] = None

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """Take the probes' answers and failed reads; send the pending keys in one probe."""
        self._absorb()
        now = monotonic()
        while self._batches and self._batches[0][0] <= now:
            deadline, keys = self._batches.popleft()
            expired = [k for k in keys if self.probing.get(k) == deadline]
            for key in expired:
                del self.probing[key]
            self._negative(expired, now)
            self.tier.stats.probe_timeouts += len(expired)
        if self.pending:
            keys = list(self.pending)
            self.pending.clear()
            if not self.backend.available:
                self.tier.stats.breaker_misses += len(keys)
                return
            deadline = now + self.backend.probe_timeout_s
            self.probing.update(dict.fromkeys(keys, deadline))
            self._batches.append((deadline, keys))
            self.tier.stats.probes += 1
            self.tier.stats.probe_keys += len(keys)
            self.backend.request_probe(keys)

    def has_pending_work(self) -> bool:
        return bool(self.pending) or bool(self.probing)

    def wait_probes(self, deadline: float | None) -> None:
        """Block until the probes in flight answered (or their own deadlines, or `deadline`, a
        `monotonic()` value, passed) and take their answers: the blocks found are then queued for
        promotion. For `wait_idle` (tests, the standalone API); the scheduler never waits.
        A probe whose answer was taken is not waited for: its batch stays queued only for `step`
        to expire (until the store's timeout after it was sent), and waiting on it would hold
        every wait of that span (each RETRY round of a load) to that deadline."""
        pause = 0.0005
        if self.probing:  # (keys still waiting for an answer: not changed by the loop below)
            latest = max(self.probing.values())
            until = latest if deadline is None else min(deadline, latest)
            while not self.backend.has_probe_results and monotonic() < until:
                sleep(pause)
                pause = min(pause * 2, 0.01)
        self._absorb()

    def _absorb(self) -> None:
        """Probe answers and failed reads handed over by the backend's threads."""
        backend = self.backend
        if backend.has_probe_results:
            now = monotonic()
            for keys, found in backend.probe_results():
                self._answer(keys, found, now)
        failed = backend.failed_keys()
        if failed:  # (counted as `rejected` by `Promotion.failed`)
            self._negative([cast(OffloadKey, k) for k in failed], monotonic())

    def _answer(self, keys: list[OffloadKey], found: list[bool] | None, now: float) -> None:
        probing = self.probing
        for key in keys:
            probing.pop(key, None)
        if found is None:
            self.tier.stats.probe_failures += 1
            self._negative(keys, now)
            return
        present = [k for k, f in zip(keys, found) if f]
        self._negative([k for k, f in zip(keys, found) if not f], now)
        self.tier.stats.probe_hits += len(present)
        self._adopt(present)

    def _adopt(self, keys: list[OffloadKey]) -> None:
        """Handles for keys found on the server (readable), and their promotions into the first
        tier. Without room for a handle each, the longest prefix that fits is adopted and the
        rest answer MISS once (then may be probed again): never RETRY forever."""
        tier = self.tier
        keys = [k for k in dict.fromkeys(keys) if tier.table.get(k) is None]
        fit = self._room(keys)
        if fit < len(keys):
            self._once(keys[fit:])
            keys = keys[:fit]
        if not keys:
            return
        blocks = tier.backend.allocate_blocks(keys)
        tier.table.insert_ready(keys, [block.block_id for block in blocks])
        if tier.retained:
            hold_entering(tier, keys)
        self._events.record(tier, keys, removed=False)  # now resident there, as far as this process knows
        top_get, running = self.top.table.get, self._promotions.running
        for key in keys:
            self.absent.pop(key, None)
            if top_get(key) is None and key not in running:
                self._promotions.request(key, tier)

    def _room(self, keys: list[OffloadKey]) -> int:
        """Make room for handles of the longest prefix of `keys` that can get it; its length."""
        make_room, tier = self._make_room, self.tier
        return longest_fit(len(keys), lambda n: make_room(tier, n, set(keys[:n])) is not None)

    def _negative(self, keys: list[OffloadKey], now: float) -> None:
        """Cache "not there" for `keys` for `negative_ttl_s`; with 0, for the next lookup only
        (the lookups waiting on the probe get their MISS, nothing is cached beyond it)."""
        ttl = self.backend.negative_ttl_s
        if ttl <= 0:
            self._once(keys)
            return
        absent = self.absent
        for key in keys:
            absent.pop(key, None)
            absent[key] = now + ttl
        while len(absent) > MAX_NEGATIVE:
            absent.popitem(last=False)

    def _once(self, keys: list[OffloadKey]) -> None:
        """The next lookup of each of `keys` answers MISS (an earlier, longer answer is kept)."""
        absent, now = self.absent, monotonic()
        for key in keys:
            if absent.get(key, ONCE) <= now:
                absent.pop(key, None)
                absent[key] = ONCE
        while len(absent) > MAX_NEGATIVE:
            absent.popitem(last=False)

    # ------------------------------------------------------------------ publish
    def _stale(self, key: OffloadKey) -> bool:
        """An idle handle that the backend no longer trusts (`ValkeyBackend.stale`)."""
        block = self.tier.table.get(key)
        return (block is not None and block.ref_cnt == 0 and key not in self._promotions.running
                and self.backend.stale(block))

    def publish(self, keys: list[OffloadKey]) -> None:
        """Start copies of the first tier's newly readable blocks `keys` that have no handle;
        what cannot start now is dropped and counted (see the module docstring)."""
        tier, top, backend = self.tier, self.top, self.backend
        get = tier.table.get
        new: list[OffloadKey] = []
        stale: list[OffloadKey] = []
        for key in keys:
            if get(key) is None:
                new.append(key)
            elif self._stale(key):
                stale.append(key)
        if stale and backend.available and backend.accepts_writes():
            tier.remove(stale)
            self._events.record(tier, stale, removed=True)
            new += stale
        if not new:
            return
        room = (backend.max_inflight_bytes - self.inflight_bytes) // backend.block_bytes
        if not backend.available or not backend.accepts_writes() or room <= 0:
            tier.stats.publish_dropped += len(new)
            return
        send = new[:room]
        if self._make_room(tier, len(send), set(send)) is None:
            tier.stats.publish_dropped += len(new)
            return
        tier.stats.publish_dropped += len(new) - len(send)
        src_ids = pin_sources(top, send)  # (newly readable in the first tier)
        dst_ids = enter_copies(tier, send)  # handles being written: pinned
        self.inflight_bytes += len(send) * backend.block_bytes
        per_job = -(-len(send) // max(1, backend.num_threads))
        for i in range(0, len(send), per_job):
            part = slice(i, i + per_job)
            self._jobs.submit(Publish(self, send[part], src_ids[part], dst_ids[part]))
