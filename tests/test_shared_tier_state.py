"""The manager's Hypothesis state machine (tests/test_manager_state.py) over a hierarchy with a
shared tier: [hot memory, warm memory, valkey on a fake server], with other engines publishing,
the server evicting and corrupting values or going down, and copies that finish late or fail.

Invariants, besides the base machine's (capacity, loads pinned where they were loaded from,
readable local blocks hold their bytes, clean keys readable below): a HIT always serves the bytes
stored for its key (a value corrupted on the server is never served); the shared tier's handles
never exceed its capacity; a handle being written is never evicted while its copy runs.
Deterministic: copies run when the machine says so and probes are answered at once (the fake
server's I/O happens on the test's thread, which the real backend never does)."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_manager_state import BLOCK, CTX, UNIVERSE, DeferredCopy, ManagerMachine, content

from kvtier import build_hierarchy, load_config_text
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.core.types import TransferResult
from kvtier.testing.fake_remote import FakeServer
from kvtier.tiers.remote.backend import ValkeyBackend
from kvtier.tiers.remote.handler import CPUToRemoteHandler, RemoteToCPUHandler
from kvtier.tiers.remote.spec import RemoteLoadStoreSpec
from kvtier.transfer.handlers.base import TransferHandler

_names = itertools.count()


class DeferredRemote(TransferHandler):
    """CPU <-> REMOTE copies run by the real handler's copy, when the machine says so."""

    def __init__(self, real):
        super().__init__()
        self.real = real
        self.queue = []

    def submit(self, job_id, src, dst):
        self.queue.append((job_id, src, dst))

    def run(self, fail: bool) -> None:
        queue, self.queue = self.queue, []
        for job_id, src, dst in queue:
            ok = not fail
            if ok:
                try:
                    self.real.copy(src, dst)
                except Exception:  # noqa: BLE001 - a read that fails verification fails the job
                    ok = False
            self.report(TransferResult(job_id, ok, 0, 0.0))


class InlineProbes(ValkeyBackend):
    """Probes answered at once (deterministic), by the fake store built with the tier."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inline_answers: list = []

    def request_probe(self, keys):
        try:
            found = [bool(f) for f in self.store.probe(list(keys))]
        except Exception:  # noqa: BLE001 - a failed probe answers None, as the probe thread does
            found = None
        self.inline_answers.append((list(keys), found))

    def probe_results(self):
        answers, self.inline_answers = self.inline_answers, []
        return answers

    @property
    def has_probe_results(self) -> bool:
        return bool(self.inline_answers)


class SharedMachine(ManagerMachine):
    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.server = FakeServer()
        InlineProbes.store_factory = staticmethod(self.server.store)  # type: ignore[assignment]
        text = f"""
block_bytes: {BLOCK}B
tiers:
  - {{name: hot, backend: memory, capacity: 6 blocks, policy: arc, reserve: 0.34}}
  - {{name: warm, backend: memory, capacity: 10 blocks, policy: lru}}
  - {{name: shared, backend: '{__name__}:InlineProbes', capacity: 12 blocks, url: 'redis://fake:1',
      negative_ttl_s: 0, breaker_failures: 1000, threads: 1}}
"""
        self.h = build_hierarchy(load_config_text(text), model="state-machine")
        self.copier = DeferredCopy(self.h.backends)
        self.h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, self.copier)
        backends = self.h.backends
        self.to_remote = DeferredRemote(CPUToRemoteHandler({"hot": backends["hot"]}, {"shared": backends["shared"]}, 1))
        self.from_remote = DeferredRemote(RemoteToCPUHandler({"hot": backends["hot"]}, {"shared": backends["shared"]},
                                                             1))
        self.h.router.register(CPULoadStoreSpec, RemoteLoadStoreSpec, self.to_remote)
        self.h.router.register(RemoteLoadStoreSpec, CPULoadStoreSpec, self.from_remote)
        self.other = self.server.store({"timeout_s": 1.0}, key_prefix="kvt", fingerprint="state-machine",
                                       layout=self.h.backends["shared"].layout, block_bytes=BLOCK)
        self.m = self.h.manager
        self.pending_stores = []
        self.loads = []

    def teardown(self):
        for handler in (self.copier, self.to_remote, self.from_remote):
            handler.run(fail=True)
        self.h.router.poll()
        self.h.backends["shared"].close()

    @rule(fail=st.booleans())
    def finish_remote_transfers(self, fail):
        self.to_remote.run(fail)
        self.from_remote.run(fail)

    @rule(key=st.sampled_from(UNIVERSE))
    def another_engine_publishes(self, key):
        if not self.server.down:
            self.other.write_block(key, memoryview(content(key)))

    @rule(key=st.sampled_from(UNIVERSE), fail=st.booleans())
    def found_in_the_shared_tier(self, key, fail):
        """The whole find-before-compute path at once (the separate rules rarely line it up):
        another engine publishes, a lookup asks, the step probes and promotes, the copy ends."""
        self.another_engine_publishes(key)
        self.m.lookup(key, CTX)
        self.m.on_schedule_end()
        self.from_remote.run(fail)
        self.lookup_and_load(key)

    @rule(key=st.sampled_from(UNIVERSE))
    def server_evicts(self, key):
        self.server.evict(key)

    @rule(key=st.sampled_from(UNIVERSE))
    def server_corrupts(self, key):
        self.server.corrupt(key)

    @rule(down=st.booleans())
    def server_down(self, down):
        self.server.down = down

    @invariant()
    def readable_blocks_hold_their_bytes(self):
        for tier in self.m.tiers[:2]:
            backend = self.h.backends[tier.name]
            for key in list(tier.policy.keys()):
                block = tier.policy.get(key)
                if block.ref_cnt >= 0:
                    assert bytes(backend.view(block.block_id)) == content(key), (
                        f"{tier.name}: readable {key.hex()} holds other bytes than were stored")

    @invariant()
    def clean_keys_are_readable_below(self):
        hot, warm, _ = self.m.tiers
        for key in hot.clean:
            below = warm.policy.get(key)
            assert below is not None and below.ref_cnt >= 0, f"{key.hex()} is clean in hot but not readable in warm"

    @invariant()
    def handles_being_written_stay(self):
        shared = self.m.tiers[2]
        for job_id, _src, dst in self.to_remote.queue:
            for key, slot in zip(dst.keys, dst.block_ids):
                block = shared.policy.get(key)
                assert block is not None and block.block_id == slot and block.ref_cnt == -1, (
                    f"handle of {key.hex()} left while its publish (job {job_id}) runs")


TestSharedTierStateMachine = SharedMachine.TestCase
TestSharedTierStateMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------- the machine catches defects
class ServesRejected(InlineProbes):
    """Broken: a value that fails verification is served anyway (its bytes were already copied)."""

    def get_blocks(self, keys, buffers, deadline=None):
        try:
            return super().get_blocks(keys, buffers, deadline)
        except Exception as exc:  # noqa: BLE001
            if type(exc.__cause__).__name__ != "ValueRejected":
                raise
            return len(keys) * self.block_bytes


class Unverified(SharedMachine):
    def __init__(self):
        super().__init__()
        self.h.backends["shared"].__class__ = ServesRejected
        self.from_remote.real.remotes["shared"].__class__ = ServesRejected


def test_the_machine_catches_a_corrupt_value_served():
    import pytest
    from hypothesis.stateful import run_state_machine_as_test
    from test_manager_state import FIND_FAST

    with pytest.raises(AssertionError, match="holds other bytes|!="):
        run_state_machine_as_test(Unverified, settings=FIND_FAST)
