"""`ManagerTests`: the conformance suite of the `OffloadingManager` protocol.

The suite drives a manager the way vLLM's scheduler does (`SchedulerDriver`): each step it looks
up every waiting request's blocks until the first that is not a HIT, pins the hits with
`prepare_load`, asks `prepare_store` for the rest, and ends the step with `on_schedule_end`; the
worker's copies finish during the next step (`complete_load`, `complete_store`). A request whose
lookup answers RETRY or HIT_PENDING is asked again on a later step.

From the manager's events (`take_events`, enabled by the subclass) and the driver's own calls,
the driver keeps a model of which blocks each tier holds and checks after every call:

- every event pairs up: a block is stored in a tier before it is removed from it, and not
  stored twice without a removal in between;
- no tier ever holds more blocks than its capacity;
- a block pinned by `prepare_load` is not removed from the tier it was loaded from (events,
  `evicted_keys`) until `complete_load`;
- lookups agree with the model: HIT only for a block some tier holds; RETRY / HIT_PENDING settle
  within a few steps; MISS for a held block only while pins and writes may leave no room to bring
  it closer (vLLM then recomputes it) - with nothing pinned or being written, a held block is found;
- `prepare_store` answers None when it has no room (never raises), and stores only keys asked for;
- after `reset_cache` no unpinned block is found (removal events for it are optional: vLLM's
  own managers emit none).

A manager with a shared tier (`asks_others = True`) may answer RETRY for any key while it asks the
server (the answer must settle), and after a reset may find again what the server kept.

Subclass hooks: `make_manager` (events enabled), `capacities` (blocks per tier), optionally
`close_manager`. A tier is named by `OffloadingEvent.tier`, or its medium when that is None, and
a spec by its `tier` attribute when a tier has that name, else by its medium.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Collection, Iterable, Sequence

from kvtier.interfaces import OffloadingManager
from kvtier.keys import OffloadKey, make_offload_key
from kvtier.specs import CompositeLoadStoreSpec, LoadStoreSpec
from kvtier.types import LookupResult, ReqContext

__all__ = ["ManagerTests", "SchedulerDriver"]

#: a RETRY / HIT_PENDING answer is stuck once it lasted this many steps AND this many seconds (real
#: copies on a loaded machine need wall time, however many steps pass meanwhile)
SETTLE_STEPS = 50
SETTLE_SECONDS = 10.0
#: seconds a manager may take to finish its background work when idle
IDLE_SECONDS = 20.0


def _spec_tier(spec: LoadStoreSpec, tiers: Collection[str]) -> str:
    """The tier a spec addresses: its `tier` when the model knows that name, else its medium."""
    tier = getattr(spec, "tier", None)
    return tier if isinstance(tier, str) and tier in tiers else spec.medium()


def _load_tiers(spec: LoadStoreSpec, count: int, tiers: Collection[str]) -> list[str]:
    """The tier each of `count` loaded blocks comes from (positions of a composite spec)."""
    if isinstance(spec, CompositeLoadStoreSpec):
        where = [""] * count
        for part, positions in spec.parts:
            for p in positions:
                where[p] = _spec_tier(part, tiers)
        assert "" not in where, \
            f"a composite load spec leaves positions {[i for i, t in enumerate(where) if not t]} out"
        return where
    assert len(spec) == count, f"prepare_load of {count} blocks returned a spec of {len(spec)}"
    return [_spec_tier(spec, tiers)] * count


class SchedulerDriver:
    """Calls a manager like vLLM's scheduler and checks every answer against a model built from
    its events. `capacities` maps tier name (or medium) -> blocks."""

    def __init__(self, manager: OffloadingManager, capacities: dict[str, int], asks_others: bool = False):
        self.m = manager
        self.asks_others = asks_others  # a shared tier: RETRY while the server is asked about any key
        self.capacities = dict(capacities)
        self.ctx = ReqContext("conformance")
        self.resident: dict[str, set[OffloadKey]] = {t: set() for t in capacities}
        self.pins: dict[OffloadKey, Counter[str]] = {}
        self.writing: set[OffloadKey] = set()
        self.known: set[OffloadKey] = set()  # ever asked to store
        self.loads: list[tuple[list[OffloadKey], list[str]]] = []  # in flight: (keys, tier of each)
        self.stores: list[list[OffloadKey]] = []
        self.waiting: list[tuple[list[OffloadKey], int, float]] = []  # (request blocks, steps waited, since)
        self.removed_events = 0
        self.idle_refusals: dict[OffloadKey, int] = {}
        self.answers: Counter[LookupResult] = Counter()
        self.loaded_blocks = 0

    # ------------------------------------------------------------------ model
    def held(self, key: OffloadKey) -> bool:
        return any(key in keys for keys in self.resident.values())

    def pinned_in(self, key: OffloadKey, tier: str) -> bool:
        return self.pins.get(key, Counter())[tier] > 0

    def drain_events(self) -> None:
        """Apply the manager's events to the model, checking that they pair up."""
        for event in self.m.take_events():
            tier = event.tier if event.tier is not None else event.medium
            assert tier in self.resident, f"event for unknown tier {tier!r} (capacities name {sorted(self.resident)})"
            held = self.resident[tier]
            for key in event.keys:
                if event.removed:
                    assert key in held, f"tier {tier}: block {key.hex()} removed but never stored there"
                    assert not self.pinned_in(key, tier), (
                        f"tier {tier}: block {key.hex()} removed while pinned by prepare_load")
                    held.discard(key)
                    self.removed_events += 1
                else:
                    assert key not in held, f"tier {tier}: block {key.hex()} stored twice without a removal"
                    held.add(key)
            assert len(held) <= self.capacities[tier], (
                f"tier {tier} holds {len(held)} blocks, capacity {self.capacities[tier]}")

    def forget_unpinned(self) -> None:
        """After `reset_cache`: no tier holds an unpinned block any more."""
        for tier, keys in self.resident.items():
            keys.intersection_update(k for k in keys if self.pinned_in(k, tier))

    # ------------------------------------------------------------------ calls
    def lookup(self, key: OffloadKey) -> LookupResult:
        result = self.m.lookup(key, self.ctx)
        self.answers[result] += 1
        self.drain_events()
        if result is not LookupResult.MISS:
            self.idle_refusals.pop(key, None)
        if result is LookupResult.HIT:
            assert self.held(key), f"lookup answered HIT for {key.hex()}, which no tier holds"
        elif result is LookupResult.MISS:
            if self.held(key):
                self._refusal(key)
        elif not (self.asks_others and result is LookupResult.RETRY):  # HIT_PENDING, RETRY
            assert key in self.known, f"lookup answered {result.name} for {key.hex()}, never stored"
        return result

    def busy(self) -> bool:
        """Whether blocks are pinned or being written (they may leave a manager no room)."""
        return bool(self.pins or self.writing or self.loads or self.stores)

    def _refusal(self, key: OffloadKey) -> None:
        """A MISS for a block some tier holds: the manager declined to bring it closer. Allowed
        while pins and writes may leave it no room (vLLM then recomputes the block); when nothing
        is pinned or written, at most once (the answer to an earlier refusal), then never again."""
        where = [t for t, k in self.resident.items() if key in k]
        if self.busy():
            return
        self.idle_refusals[key] = self.idle_refusals.get(key, 0) + 1
        assert self.idle_refusals[key] <= 1, (
            f"lookup answers MISS for {key.hex()}, held by {where}, with nothing pinned or being written")

    def settle(self, key: OffloadKey) -> LookupResult:
        """Look `key` up until the answer is HIT or MISS, stepping meanwhile (RETRY: ask again next step)."""
        since, steps = time.monotonic(), 0
        while True:
            result = self.lookup(key)
            if result is LookupResult.HIT or (result is LookupResult.MISS and not self.held(key)):
                return result
            steps += 1
            if _stuck(steps, since):
                raise AssertionError(f"lookup of {key.hex()} still answers {result.name} after {steps} steps "
                                     f"and {SETTLE_SECONDS:g} s")
            self.step_end()
            time.sleep(0.001)  # a background copy may need wall time

    def load(self, keys: list[OffloadKey]) -> None:
        """`prepare_load` (pins), the copy finishing next step."""
        spec = self.m.prepare_load(keys, self.ctx)
        self.drain_events()
        tiers = _load_tiers(spec, len(keys), self.resident)
        for key, tier in zip(keys, tiers):
            assert key in self.resident.get(tier, ()), \
                f"prepare_load of {key.hex()} points at tier {tier}, which does not hold it"
            self.pins.setdefault(key, Counter())[tier] += 1
        self.loads.append((keys, tiers))
        self.loaded_blocks += len(keys)

    def store(self, keys: list[OffloadKey]) -> list[OffloadKey] | None:
        """`prepare_store`, the copy finishing next step. Returns the keys to store, or None."""
        self.known.update(keys)
        out = self.m.prepare_store(keys, self.ctx)
        if out is None:
            self.drain_events()
            return None
        tier = _spec_tier(out.store_spec, self.resident)
        for key in out.evicted_keys:
            assert not self.pinned_in(key, tier), f"prepare_store evicted {key.hex()}, pinned in {tier}"
        self.drain_events()
        assert set(out.keys_to_store) <= set(keys), "prepare_store chose keys it was not asked to store"
        assert len(out.store_spec) == len(out.keys_to_store)
        assert not set(out.keys_to_store) & self.writing, "prepare_store handed out a block already being written"
        self.writing.update(out.keys_to_store)
        self.stores.append(list(out.keys_to_store))
        return out.keys_to_store

    def finish_transfers(self, success: bool = True) -> None:
        """The worker's copies of the previous step end: unpin loads, complete stores."""
        loads, self.loads = self.loads, []
        for keys, tiers in loads:
            self.m.complete_load(keys, self.ctx)
            for key, tier in zip(keys, tiers):
                self.pins[key][tier] -= 1
                if not +self.pins[key]:
                    del self.pins[key]
            self.drain_events()
        stores, self.stores = self.stores, []
        for keys in stores:
            self.m.complete_store(keys, self.ctx, success=success)
            self.writing.difference_update(keys)
            self.drain_events()
            if not success:
                for key in keys:
                    result = self.lookup(key)
                    assert result is LookupResult.MISS or self.held(key) or (
                        self.asks_others and result is LookupResult.RETRY), key.hex()

    def step_end(self) -> None:
        self.m.on_schedule_end()
        self.drain_events()

    def schedule(self, request: list[OffloadKey]) -> bool:
        """One scheduling attempt: False when the request must wait (RETRY / HIT_PENDING)."""
        hits = 0
        for key in request:
            result = self.lookup(key)
            if result is LookupResult.HIT:
                hits += 1
                continue
            if result is not LookupResult.MISS:
                return False
            break
        if hits:
            self.load(request[:hits])
        self.m.touch(request, self.ctx)
        if request[hits:]:
            self.store(request[hits:])
        return True

    def step(self, new_requests: Iterable[list[OffloadKey]] = ()) -> None:
        """One scheduler step: last step's copies end, waiting and new requests are scheduled."""
        self.finish_transfers()
        now = time.monotonic()
        queue = self.waiting + [(r, 0, now) for r in new_requests]
        self.waiting = []
        for request, waited, since in queue:
            if not self.schedule(request):
                assert not _stuck(waited, since), (f"a request waited {waited} steps and {SETTLE_SECONDS:g} s "
                                                   f"on RETRY / HIT_PENDING")
                self.waiting.append((request, waited + 1, since))
        self.step_end()

    def idle(self) -> None:
        """Steps without new requests until nothing waits and the manager has no pending work."""
        deadline = time.monotonic() + IDLE_SECONDS
        while self.waiting or self.loads or self.stores or self.m.has_pending_work():
            assert time.monotonic() < deadline, "the manager still has pending work after the idle deadline"
            self.step()
            time.sleep(0.001)


def _stuck(steps: int, since: float) -> bool:
    """Whether an answer that first came `steps` steps ago, at `since`, is stuck (see SETTLE_STEPS)."""
    return steps >= SETTLE_STEPS and time.monotonic() - since >= SETTLE_SECONDS


def make_keys(n: int, start: int = 0) -> list[OffloadKey]:
    return [make_offload_key((0x6D67 << 40 | i).to_bytes(8, "big"), 0) for i in range(start, start + n)]


class ManagerTests:
    """Conformance suite for an `OffloadingManager`; subclass it and implement the hooks.

    Test methods take pytest's `tmp_path` (any directory when called directly).
    """

    seed = 7
    #: documents (prefix chains) the trace draws requests from, and blocks per document at most
    documents = 12
    document_blocks = 5
    steps = 60

    # ------------------------------------------------------------------ hooks
    def make_manager(self, tmp_path) -> OffloadingManager:
        """A fresh, empty manager with events enabled."""
        raise NotImplementedError

    def capacities(self, manager: OffloadingManager) -> dict[str, int]:
        """Blocks each tier holds at most, by tier name (or medium, for events that name no tier)."""
        raise NotImplementedError

    def close_manager(self, manager: OffloadingManager) -> None:
        manager.shutdown()

    #: True for a manager with a shared tier (other engines' blocks): it may answer RETRY for a key
    #: it never stored while it asks the server (the answer must still settle)
    asks_others: bool = False

    # ------------------------------------------------------------------ helpers
    def _driver(self, tmp_path) -> SchedulerDriver:
        manager = self.make_manager(tmp_path)
        return SchedulerDriver(manager, self.capacities(manager), self.asks_others)

    def _trace(self, rng: random.Random) -> list[list[list[OffloadKey]]]:
        """Per step, the new requests: a prefix of a shared document plus a few fresh blocks."""
        docs = [make_keys(self.document_blocks, 1000 * (d + 1)) for d in range(self.documents)]
        fresh = iter(make_keys(10_000, 100_000))
        steps = []
        for _ in range(self.steps):
            requests = []
            for _ in range(rng.randint(0, 2)):
                doc = rng.choice(docs)
                requests.append(doc[:rng.randint(1, len(doc))] + [next(fresh) for _ in range(rng.randint(0, 1))])
            steps.append(requests)
        return steps

    def _check_lookups_match_model(self, d: SchedulerDriver, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if d.settle(key) is LookupResult.HIT:
                d.load([key])
                d.finish_transfers()

    # ------------------------------------------------------------------ tests
    def test_scheduler_trace(self, tmp_path):
        d = self._driver(tmp_path)
        try:
            rng = random.Random(self.seed)
            for requests in self._trace(rng):
                d.step(requests)
            d.idle()
            assert d.removed_events > 0, "the trace never filled the manager; give it more steps or less capacity"
            assert d.loaded_blocks > 0, "the trace never loaded a block"
            self._check_lookups_match_model(d, sorted(d.known))
            d.idle()
        finally:
            self.close_manager(d.m)

    def test_stored_blocks_are_found(self, tmp_path):
        d = self._driver(tmp_path)
        try:
            keys = make_keys(2)
            d.store(keys)
            assert all(d.lookup(k) is not LookupResult.MISS for k in keys), "a block being written answered MISS"
            d.finish_transfers()
            d.step_end()
            for key in keys:
                assert d.settle(key) is LookupResult.HIT, f"{key.hex()} stored, nothing evicted, yet not found"
        finally:
            self.close_manager(d.m)

    def test_failed_store_leaves_nothing(self, tmp_path):
        d = self._driver(tmp_path)
        try:
            keys = make_keys(2)
            d.store(keys)
            d.finish_transfers(success=False)
            d.step_end()
            lookup = d.settle if self.asks_others else d.lookup  # a shared tier asks the server first
            assert [lookup(k) for k in keys] == [LookupResult.MISS] * 2
            assert not any(d.resident.values()), f"a failed store left blocks: {d.resident}"
        finally:
            self.close_manager(d.m)

    def test_prepare_store_answers_none_when_full(self, tmp_path):
        d = self._driver(tmp_path)
        try:
            total = sum(d.capacities.values())
            keys = iter(make_keys(total + 2))
            answers = [d.store([next(keys)]) for _ in range(total + 2)]  # never completed: nothing evictable
            assert None in answers, "prepare_store kept accepting blocks past every tier's capacity"
            first_none = answers.index(None)
            assert first_none > 0, "prepare_store refused a block into an empty manager"
            d.finish_transfers(success=False)
        finally:
            self.close_manager(d.m)

    def test_pinned_blocks_are_not_evicted(self, tmp_path):
        d = self._driver(tmp_path)
        try:
            pinned = make_keys(2)
            d.store(pinned)
            d.finish_transfers()
            d.step_end()
            for key in pinned:
                assert d.settle(key) is LookupResult.HIT
            spec_keys = list(pinned)
            d.load(spec_keys)
            loads = d.loads
            d.loads = []  # held across the pressure below: the load has not finished
            pressure = make_keys(3 * sum(d.capacities.values()), 500)
            for i in range(0, len(pressure), 2):
                d.store(pressure[i:i + 2])
                d.idle()  # the stores end, background copies (cascade) finish
            assert d.removed_events > 0, "no eviction happened: the test applied no pressure"
            for key in pinned:
                assert d.lookup(key) is LookupResult.HIT, f"pinned block {key.hex()} is no longer readable"
            d.loads = loads
            d.finish_transfers()
            d.idle()
        finally:
            self.close_manager(d.m)

    def test_reset_cache_removes_every_block(self, tmp_path):
        d = self._driver(tmp_path)
        try:
            for requests in self._trace(random.Random(self.seed + 1))[:20]:
                d.step(requests)
            d.idle()
            assert any(d.resident.values())
            d.m.reset_cache()
            d.drain_events()
            d.forget_unpinned()  # vLLM's own managers emit no removal events on reset
            for key in sorted(d.known):
                # A shared tier's server keeps what this manager published: found again only by a probe.
                answer = d.lookup(key)
                assert answer is LookupResult.MISS or (self.asks_others and answer is LookupResult.RETRY), \
                    f"{key.hex()} is still found after reset_cache"
        finally:
            self.close_manager(d.m)
