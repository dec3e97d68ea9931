"""A Hypothesis state machine over the hierarchy manager with transfers that finish late or fail.

Invariants after every step: no tier holds more blocks than its capacity; a block pinned by
`prepare_load` stays in the tier it was loaded from (the same slot, still pinned) until
`complete_load`; every readable block, in any tier, holds exactly the bytes that were stored for
its key; a tier's "clean" keys are really readable one tier down.

The tests at the end break the manager (or the copies) in one way each and check that the
machine notices: every invariant can fail.
"""

from collections import Counter

import pytest
from conftest import keys, memory_hierarchy
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvtier import CPULoadStoreSpec, LookupResult, ReqContext
from kvtier.core.types import TransferResult
from kvtier.transfer.handlers.base import TransferHandler

UNIVERSE = keys(24)
CTX = ReqContext("sm")
BLOCK = 32


def content(key: bytes) -> bytes:
    return (key * 4)[:BLOCK]


class DeferredCopy(TransferHandler):
    """Copies between memory tiers only when the test says so, possibly failing."""

    def __init__(self, backends):
        super().__init__()
        self.backends = backends
        self.queue = []

    def submit(self, job_id, src, dst):
        self.queue.append((job_id, src, dst))

    def run(self, fail: bool) -> None:
        queue, self.queue = self.queue, []
        for job_id, src, dst in queue:
            if not fail:
                s, d = self.backends[src.tier], self.backends[dst.tier]
                for a, b in zip(src.block_ids, dst.block_ids):
                    d.view(b)[:] = s.view(a)
            self.report(TransferResult(job_id, not fail, 0, 0.0))


class ManagerMachine(RuleBasedStateMachine):
    HIERARCHY = dict(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy="arc")  # subclasses vary it

    def __init__(self):
        super().__init__()
        self.h = memory_hierarchy(**self.HIERARCHY)
        self.copier = DeferredCopy(self.h.backends)
        self.h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, self.copier)
        self.m = self.h.manager
        self.pending_stores: list[list[bytes]] = []
        self.loads: list[tuple[bytes, str, object]] = []  # (key, tier loaded from, its BlockStatus)

    def teardown(self):
        self.copier.run(fail=True)
        self.h.router.poll()

    @rule(picks=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4, unique=True))
    def prepare_store(self, picks):
        out = self.m.prepare_store(picks, CTX)
        if out is None:
            return
        hot = self.h.backends["hot"]
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            hot.view(slot)[:] = content(key)
        self.pending_stores.append(out.keys_to_store)

    @precondition(lambda self: self.pending_stores)
    @rule(success=st.booleans())
    def complete_store(self, success):
        self.m.complete_store(self.pending_stores.pop(0), CTX, success=success)

    @rule(key=st.sampled_from(UNIVERSE))
    def lookup_and_load(self, key):
        if self.m.lookup(key, CTX) is LookupResult.HIT:
            spec = self.m.prepare_load([key], CTX)
            backend = self.h.backends[spec.tier]
            assert bytes(backend.view(spec.block_ids[0])) == content(key)
            self.loads.append((key, spec.tier, self.tier(spec.tier).policy.get(key)))

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data):
        key, _, _ = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load([key], CTX)

    @rule()
    def end_step(self):
        self.m.on_schedule_end()

    @rule(fail=st.booleans())
    def finish_transfers(self, fail):
        self.copier.run(fail)

    @invariant()
    def capacity_never_exceeded(self):
        for tier in self.m.tiers:
            assert len(tier.policy) <= tier.capacity, f"{tier.name} holds {len(tier.policy)} > capacity {tier.capacity}"
            free = tier.backend.get_num_free_blocks()
            assert len(tier.policy) + free == tier.capacity, (
                f"{tier.name}: {len(tier.policy)} held + {free} free slots != capacity {tier.capacity}")

    def tier(self, name):
        return next(t for t in self.m.tiers if t.name == name)

    @invariant()
    def pinned_blocks_stay_where_they_were_loaded_from(self):
        pins = Counter((key, tier) for key, tier, _ in self.loads)
        for key, tier, block in self.loads:
            policy = self.tier(tier).policy
            now = policy.get(key)
            # (a policy with views: the same block is the same slot; else the very object)
            same = now is not None and now.block_id == block.block_id if policy.returns_views else now is block
            assert same, f"{key.hex()}, loaded from {tier}, left that tier before complete_load"
            assert block.ref_cnt >= pins[(key, tier)], (
                f"{key.hex()} in {tier}: {pins[(key, tier)]} loads pending but ref_cnt {block.ref_cnt}")

    @invariant()
    def readable_blocks_hold_their_bytes(self):
        for tier in self.m.tiers:
            backend = self.h.backends[tier.name]
            for key in list(tier.policy.keys()):
                block = tier.policy.get(key)
                if block.ref_cnt >= 0:
                    assert bytes(backend.view(block.block_id)) == content(key), (
                        f"{tier.name}: readable {key.hex()} holds other bytes than were stored")

    @invariant()
    def clean_keys_are_readable_below(self):
        hot, warm = self.m.tiers
        for key in hot.clean:
            assert hot.policy.get(key) is not None
            below = warm.policy.get(key)
            assert below is not None and below.ref_cnt >= 0, f"{key.hex()} is clean in hot but not readable in warm"


TestManagerStateMachine = ManagerMachine.TestCase
TestManagerStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------- every invariant can fail
# Each mutated run stops at its first counterexample, so the budget costs only where a defect is hard to
# reach; 300 examples missed "pinned-evicted" when other imports changed the order of identity-hashed sets.
FIND_FAST = settings(max_examples=2000, stateful_step_count=40, deadline=None, derandomize=True, database=None,
                     phases=[Phase.generate])


class PinsAnotherCopy(ManagerMachine):
    """prepare_load moves its pin to the copy one tier down (the defect the old invariant,
    "some copy is pinned", accepted): the copy actually read can then be evicted under the load."""

    def __init__(self):
        super().__init__()
        hot, warm = self.m.tiers
        prepare, complete, moved = self.m.prepare_load, self.m.complete_load, Counter()

        def prepare_load(keys, ctx=None):
            spec = prepare(keys, ctx)
            for key in keys:
                if spec.tier == hot.name and warm.table.readable_run([key]):
                    # through the block tables, as the manager changes every pin
                    hot.table.release_loads([key])
                    warm.table.pin_loads([key])
                    moved[key] += 1
            return spec

        def complete_load(keys, ctx=None):
            for key in keys:
                if moved[key]:
                    moved[key] -= 1
                    warm.table.release_loads([key])
                    hot.table.pin_loads([key])
            complete(keys, ctx)

        self.m.prepare_load, self.m.complete_load = prepare_load, complete_load


class EvictsPinnedCopy(ManagerMachine):
    """prepare_store drops pinned hot blocks that have a readable copy below (as if the copy
    could serve the load that is reading the hot one)."""

    def __init__(self):
        super().__init__()
        prepare = self.m.prepare_store

        def prepare_store(keys, ctx=None):
            hot, warm = self.m.tiers
            loading = {k for k, _, _ in self.loads}
            for key in list(hot.table.keys()):
                block = hot.table.get(key)
                if key in loading and warm.table.readable_run([key]):
                    hot.table.forget([key])
                    hot.backend.free(block)
                    hot.clean.discard(key)
            return prepare(keys, ctx)
        self.m.prepare_store = prepare_store


class LeaksSlots(ManagerMachine):
    """The hot tier's backend loses a free slot at each allocation (handed out, never returned)."""

    def __init__(self):
        super().__init__()
        hot = self.h.backends["hot"]
        allocate = hot.allocate_block_ids

        def leaky(keys):
            ids = allocate(keys)
            if hot.get_num_free_blocks():
                allocate(keys[:1])
            return ids
        hot.allocate_block_ids = leaky


class CorruptsCopies(ManagerMachine):
    """Copies between tiers flip the first byte of every block and report success."""

    def __init__(self):
        super().__init__()
        run = self.copier.run

        def corrupt_run(fail):
            queue = list(self.copier.queue)
            run(fail)
            for _, _, dst in queue if not fail else ():
                for slot in dst.block_ids:
                    view = self.h.backends[dst.tier].view(slot)
                    view[0] ^= 0xFF
        self.copier.run = corrupt_run


class CleanTooEarly(ManagerMachine):
    """complete_store marks blocks clean (safe to drop) before any copy reached the next tier."""

    def __init__(self):
        super().__init__()
        complete = self.m.complete_store

        def complete_store(keys, ctx=None, success=True):
            complete(keys, ctx, success=success)
            if success:
                hot = self.m.tiers[0]
                hot.clean.update(k for k in keys if hot.policy.get(k) is not None)
        self.m.complete_store = complete_store


@pytest.mark.parametrize("machine, message", [
    (PinsAnotherCopy, "loads pending but ref_cnt"),
    (EvictsPinnedCopy, "left that tier before complete_load"),
    (LeaksSlots, "free slots != capacity"),
    (CorruptsCopies, "holds other bytes"),
    (CleanTooEarly, "clean in hot but not readable in warm"),
], ids=["pin-moved", "pinned-evicted", "capacity", "bytes", "clean"])
def test_each_invariant_catches_its_defect(machine, message):
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(machine, settings=FIND_FAST)
