"""A Hypothesis state machine over the hierarchy manager with transfers that finish late or fail.

Invariants after every step: no tier holds more blocks than its capacity; blocks pinned by loads
are still resident and readable; every readable block, in any tier, holds exactly the bytes that
were stored for its key; a tier's "clean" keys are really readable one tier down.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import CPULoadStoreSpec, LookupResult, ReqContext
from kvtier.handlers.base import TransferHandler
from kvtier.types import TransferResult

from conftest import keys, memory_hierarchy

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
            self._on_done(TransferResult(job_id, not fail, 0, 0.0))


class ManagerMachine(RuleBasedStateMachine):
    HIERARCHY = dict(hot=6, warm=10, block_bytes=BLOCK, reserve=0.34, hot_policy="arc")  # subclasses vary it

    def __init__(self):
        super().__init__()
        self.h = memory_hierarchy(**self.HIERARCHY)
        self.copier = DeferredCopy(self.h.backends)
        self.h.engine.register(CPULoadStoreSpec, CPULoadStoreSpec, self.copier)
        self.m = self.h.manager
        self.pending_stores: list[list[bytes]] = []
        self.loads: list[bytes] = []

    def teardown(self):
        self.copier.run(fail=True)
        self.h.engine.poll()

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
            self.loads.append(key)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data):
        key = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
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
            assert len(tier.policy) <= tier.capacity
            assert len(tier.policy) + tier.backend.get_num_free_blocks() == tier.capacity

    @invariant()
    def pinned_blocks_stay_readable(self):
        for key in self.loads:
            pinned = [t.policy.get(key) for t in self.m.tiers if t.policy.get(key) is not None]
            assert any(b.ref_cnt > 0 for b in pinned)

    @invariant()
    def readable_blocks_hold_their_bytes(self):
        for tier in self.m.tiers:
            backend = self.h.backends[tier.name]
            for key in list(tier.policy.keys()):
                block = tier.policy.get(key)
                if block.ref_cnt >= 0:
                    assert bytes(backend.view(block.block_id)) == content(key), (tier.name, key)

    @invariant()
    def clean_keys_are_readable_below(self):
        hot, warm = self.m.tiers
        for key in hot.clean:
            assert hot.policy.get(key) is not None
            below = warm.policy.get(key)
            assert below is not None and below.ref_cnt >= 0


TestManagerStateMachine = ManagerMachine.TestCase
TestManagerStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
