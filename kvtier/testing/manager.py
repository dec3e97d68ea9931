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
from collections.abc import Sequence

from kvtier.core.interfaces import OffloadingManager
from kvtier.core.keys import OffloadKey
from kvtier.core.types import LookupResult
from kvtier.testing.scheduler_driver import SchedulerDriver, make_keys

__all__ = ["ManagerTests", "SchedulerDriver", "make_keys"]


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
            for i, requests in enumerate(self._trace(rng)):
                d.step(requests)
                if i % 8 == 7:
                    d.idle()  # a pause between bursts of requests: copies in the background land
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
