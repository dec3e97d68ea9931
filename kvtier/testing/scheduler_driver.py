"""`SchedulerDriver`: drives an `OffloadingManager` the way vLLM's scheduler does and keeps a
model of which blocks each tier holds, checking every call against it (see
`kvtier.testing.manager` for the rules it checks)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Iterable

from kvtier.core.interfaces import OffloadingManager
from kvtier.core.keys import OffloadKey, make_offload_key
from kvtier.core.specs import CompositeLoadStoreSpec, LoadStoreSpec
from kvtier.core.types import LookupResult, ReqContext

__all__ = ["SchedulerDriver", "make_keys"]

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
