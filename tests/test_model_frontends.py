"""The cross-front-end model test (issue 42): one random program of operations, run against the
standalone `KVTier` and against the vLLM adapter's scheduler side with its worker side (real
bytes, a real CPU tier over a real file tier, no engine: tests/model_fronts.py), checked against
a model after every step.

Operations: stores of key ranges (re-offers of resident, demoted and evicted keys come with
them), loads, lookups, a payload byte flipped or the slab cut inside a file-only block's slot,
flush, close and reopen on the same `root_dir`, two threads storing at once.

Invariants, after every step:
- nothing that fits is lost: every key stored (and not corrupted since) is resident in a tier,
  and a load or lookup finds at least the run of such keys it starts with;
- no wrong byte is ever served: every block a load returns holds its key's bytes (checked in the
  front-end), and nothing never stored is found;
- a corrupted block is a MISS for that block alone and counted once: the file tier's `failures`
  equal the corrupted blocks it dropped, and only those leave it;
- counters add up: no dirty block dropped, every slot either free or held, the engine's loads
  equal the blocks loaded;
- `close()` returns within its bound.

Budget: `KVTIER_MODEL_PROFILE` picks the profile: `ci` (default: 1,000 programs per front-end of
up to 8 steps, derandomized, about a minute each here) or `soak` (5,000 programs of up to 30
steps, random: `KVTIER_MODEL_PROFILE=soak python -m pytest tests/test_model_frontends.py`). The
tests at the end break kvtier in one way each and check that the machine notices.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from model_fronts import CLOSE_BOUND_S, PAGE, SOURCE, SharedFront, StandaloneFront, VllmFront, content

from kvtier import make_offload_key
from kvtier.tiers.file.slot_format import HEADER_BYTES

UNIVERSE = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(12)]
PROFILES = {
    "ci": settings(max_examples=1000, stateful_step_count=8, deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck)),
    "soak": settings(max_examples=5000, stateful_step_count=30, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck)),
}
PROFILE = PROFILES[os.environ.get("KVTIER_MODEL_PROFILE", "ci")]

spans = st.tuples(st.integers(0, len(UNIVERSE) - 1), st.integers(1, 6))


class FrontMachine(RuleBasedStateMachine):
    """The model: `stored` (keys that must be found), `bad` (corrupted file slots not yet found
    out: key -> slot), `ever` (keys ever stored), `dropped` and `loaded` (since the last open)."""

    FRONT: type = StandaloneFront

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(prefix="kvtier-model-")
        self.front = self.FRONT(Path(self._dir.name) / "disk")
        self.stored: set[bytes] = set()
        self.ever: set[bytes] = set()
        self.bad: dict[bytes, int] = {}
        self.dropped = 0
        self.loaded = 0
        self.history: list[str] = []  # the steps so far (a failure that depends on a copy's timing is not replayed)

    def _story(self, keys: list[bytes]) -> str:
        """The steps so far and where `keys` are now: what a failure message needs."""
        where = []
        for key in keys:
            index = UNIVERSE.index(key) if key in UNIVERSE else key.hex()
            spots = [f"{t.name}(slot {b.block_id}, ref {b.ref_cnt}{', clean' if key in t.clean else ''}"
                     f"{', condemned' if key in t.condemned else ''})"
                     for t in self.front.tiers if (b := t.policy.get(key)) is not None]
            where.append(f"key {index}: {', '.join(spots) or 'nowhere'}")
        return f"steps: {'; '.join(self.history)} | {' | '.join(where)}"

    def teardown(self) -> None:
        try:
            self.front.close()
        finally:
            self._dir.cleanup()

    # ------------------------------------------------------------------ operations
    @rule(span=spans)
    def store(self, span: tuple[int, int]) -> None:
        keys = UNIVERSE[span[0]:span[0] + span[1]]
        self.history.append(f"store {span}")
        assert self.front.store(keys), "store() returned False with room below for every key"
        self._stored(keys)

    @rule(span=spans)
    def load(self, span: tuple[int, int]) -> None:
        keys = UNIVERSE[span[0]:span[0] + span[1]]
        self.history.append(f"load {span}")
        n = self.front.load(keys)  # (the bytes of every block loaded are checked there)
        self._found(keys, n)
        self.loaded += n

    @rule(span=spans)
    def lookup(self, span: tuple[int, int]) -> None:
        keys = UNIVERSE[span[0]:span[0] + span[1]]
        self.history.append(f"lookup {span}")
        self._found(keys, self.front.lookup(keys))

    @rule()
    def flush(self) -> None:
        self.history.append("flush")
        assert self.front.flush() == 0, "flush() left blocks without a copy below, with room there"

    @rule(pick=st.integers(0, len(UNIVERSE) - 1), cut=st.booleans())
    def corrupt(self, pick: int, cut: bool) -> None:
        """Flip a payload byte of a block that only the file tier holds, or cut the slab inside
        its slot when it is the last slot in use; nothing when no block is there alone. (Which
        blocks are depends on copies in flight: the draw must not, or Hypothesis cannot replay.)"""
        eligible = sorted(self._file_only())
        if not eligible:
            return
        key = eligible[pick % len(eligible)]
        disk = self.front.tiers[1]
        slot = disk.policy.get(key).block_id
        backend = disk.backend
        cut_here = cut and slot == max(disk.policy.get(k).block_id for k in disk.policy.keys())
        if cut_here:
            os.truncate(backend.slab_path, slot * backend.slot_bytes + HEADER_BYTES + 100)
        else:
            with open(backend.slab_path, "r+b") as f:
                at = slot * backend.slot_bytes + HEADER_BYTES + 7
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ 0x5A]))
        self.history.append(f"corrupt key {UNIVERSE.index(key)} (slot {slot}, {'cut' if cut_here else 'flipped'})")
        self.stored.discard(key)
        self.bad[key] = slot

    @rule()
    def reopen(self) -> None:
        self.history.append("reopen")
        took = self.front.reopen()
        assert took < CLOSE_BOUND_S, f"close() took {took:.1f} s"
        disk = self.front.tiers[1]
        for key in [k for k in self.bad if disk.policy.get(k) is None]:
            del self.bad[key]  # (refused when the tier was opened again: not a read, not counted)
        self.dropped = self.loaded = 0

    @rule(a=spans, b=spans)
    def two_threads(self, a: tuple[int, int], b: tuple[int, int]) -> None:
        self.history.append(f"two threads store {a} and {b}")
        spans_ = [UNIVERSE[s:s + n] for s, n in (a, b)]
        answers: list[object] = []
        threads = [threading.Thread(target=lambda ks=ks, first=first: answers.append(self._store_catching(ks, first)))
                   for ks, first in zip(spans_, (SOURCE, SOURCE + 16))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answers == [True, True], answers
        for keys in spans_:
            self._stored(keys)

    def _store_catching(self, keys: list[bytes], first: int) -> object:
        try:
            return self.front.store(keys, first)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion
            return exc

    # ------------------------------------------------------------------ model
    @staticmethod
    def _rewritten(disk: Any, key: bytes, block: Any) -> bool:
        """Whether `key`'s block in its corrupted slot is a new copy: being written, or holding the
        key's own bytes again (the corrupted one was dropped, and counted, before)."""
        if block.ref_cnt < 0:
            return True
        backend = disk.backend
        with open(backend.slab_path, "rb") as f:
            f.seek(block.block_id * backend.slot_bytes + HEADER_BYTES)
            return f.read(PAGE) == content(key).numpy().tobytes()

    def _stored(self, keys: list[bytes]) -> None:
        self.stored.update(k for k in keys if k not in self.bad)  # (a stale corrupt copy below may shadow it)
        self.ever.update(keys)

    def _found(self, keys: list[bytes], n: int) -> None:
        must = next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))
        assert n >= must, f"{must - n} stored block(s) not found ({self._story(keys[n:must])})"
        assert all(k in self.ever for k in keys[:n]), "a block never stored was found"

    def _file_only(self) -> set[bytes]:
        cpu, disk = self.front.tiers[:2]
        return {k for k in self.stored
                if cpu.policy.get(k) is None and (b := disk.policy.get(k)) is not None and b.ref_cnt == 0}

    # ------------------------------------------------------------------ invariants
    @invariant()
    def nothing_stored_is_lost(self) -> None:
        tiers = self.front.tiers
        lost = [k for k in self.stored if not any(t.policy.get(k) is not None for t in tiers)]
        assert not lost, f"stored blocks gone from every tier ({self._story(lost)})"

    @invariant()
    def a_corrupted_block_is_dropped_alone_and_counted_once(self) -> None:
        # The counter is read from the tier itself, with its blocks, so that both are one state:
        # the shared front's `stats` call lets the owner work (its heartbeat may count and drop a
        # failed read after the reply, before the front holds the namespace again).
        disk = self.front.tiers[1]
        failures = disk.stats.failures
        for key, slot in list(self.bad.items()):
            block = disk.policy.get(key)
            # (condemned: never served again; rewritten: dropped, then a good copy, promoted before the
            # corruption, written down again into the same slot)
            if block is None or block.block_id != slot or key in disk.condemned or self._rewritten(disk, key, block):
                del self.bad[key]
                self.dropped += 1
        assert failures == self.dropped, f"file tier failures {failures}, corrupted blocks dropped {self.dropped}"

    @invariant()
    def counters_add_up(self) -> None:
        stats = self.front.stats()
        assert stats["cpu"]["cascade_dropped"] == 0, "a dirty block was dropped"
        assert stats["cpu"]["failures"] == 0, "a CPU-tier copy failed"
        for tier in self.front.tiers:
            held = len(tier.policy) + tier.backend.get_num_free_blocks()
            assert held == tier.capacity, f"tier {tier.name}: {held} slots held or free of {tier.capacity}"
        assert stats["engine"]["loads"] == self.loaded, f"engine loads {stats['engine']['loads']} != {self.loaded}"


class VllmMachine(FrontMachine):
    FRONT = VllmFront


class SharedMachine(FrontMachine):
    FRONT = SharedFront


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def test_standalone_front_end_against_the_model():
    run_state_machine_as_test(FrontMachine, settings=PROFILE)


def test_shared_host_front_end_against_the_model():
    run_state_machine_as_test(SharedMachine, settings=PROFILE)


@needs_vllm
def test_vllm_front_end_against_the_model():
    run_state_machine_as_test(VllmMachine, settings=PROFILE)


# ---------------------------------------------------------------------- the machine catches defects
# A defect that depends on a copy's timing may not fail again when Hypothesis replays the program
# (it then reports a flaky test, not the assertion): these tests run the machine's rules on
# random programs themselves, and stop at the first invariant that fails.
CATCH_PROGRAMS, CATCH_STEPS = 500, 12


def _random_step(machine: FrontMachine, rng: random.Random) -> None:
    def span() -> tuple[int, int]:
        return rng.randrange(len(UNIVERSE)), rng.randint(1, 6)

    steps = [lambda: machine.store(span()), lambda: machine.load(span()), lambda: machine.lookup(span()),
             machine.flush, lambda: machine.corrupt(rng.randrange(len(UNIVERSE)), rng.random() < 0.5),
             machine.reopen, lambda: machine.two_threads(span(), span())]
    rng.choice(steps)()


def _check(machine: FrontMachine) -> None:
    machine.counters_add_up()
    machine.nothing_stored_is_lost()
    machine.a_corrupted_block_is_dropped_alone_and_counted_once()


def _catches(machine: type, match: str) -> None:
    """Some random program of the machine's rules fails an invariant whose message matches `match`."""
    rng = random.Random(20261129)
    for _ in range(CATCH_PROGRAMS):
        m = machine()
        try:
            for _ in range(CATCH_STEPS):
                _random_step(m, rng)
                _check(m)
        except AssertionError as exc:
            assert re.search(match, str(exc)), exc
            return
        finally:
            m.teardown()
    raise AssertionError(f"no program of {CATCH_PROGRAMS} found the defect ({match})")


@pytest.mark.parametrize("machine", [FrontMachine, pytest.param(VllmMachine, marks=needs_vllm)])
def test_the_machine_catches_a_dirty_block_evicted(machine, monkeypatch):
    """7e6c7c1's eviction: the unsafe victims are not protected, dirty blocks go: the counters say
    so, and without them (a machine that does not read them) the lost blocks are found missing."""
    monkeypatch.setattr("kvtier.control.cascade.unsafe_ahead", lambda tier, need, protected: set())
    _catches(machine, "a dirty block was dropped")

    class NoCounters(machine):  # type: ignore[misc,valid-type]
        def counters_add_up(self) -> None:
            return

    _catches(NoCounters, "not found|gone from every tier")


def test_the_machine_catches_a_corrupt_block_served(monkeypatch):
    """Verification that forgets nothing and raises nothing: the corrupt bytes are loaded."""
    monkeypatch.setattr("kvtier.tiers.file.direct.DirectPath.reject", lambda self, bad: None)
    _catches(FrontMachine, "wrong bytes served")


def test_the_machine_catches_a_failed_job_dropping_its_good_blocks(monkeypatch):
    """7e6c7c1's outcome under vLLM: every block of a failed load dropped, not the bad one alone."""
    from kvtier.core.types import TransferResult

    monkeypatch.setattr(TransferResult, "failed_positions", lambda self, n: [] if self.success else list(range(n)))
    _catches(FrontMachine, "not found|gone from every tier|file tier failures")


def test_the_machine_catches_counters_that_do_not_add_up(monkeypatch):
    """7e6c7c1's engine totals: one per call, not per block."""
    from kvtier.standalone.counters import TransferCounters

    original = TransferCounters.count
    monkeypatch.setattr(TransferCounters, "count", lambda self, kind, result, blocks: original(
        self, kind, result, min(blocks, 1)))
    _catches(FrontMachine, "engine loads")


def test_the_machine_catches_a_slow_close(monkeypatch):
    import time as time_

    from kvtier.control.hierarchy import Hierarchy

    original = Hierarchy.close
    monkeypatch.setattr("model_fronts.CLOSE_BOUND_S", 0.05)
    monkeypatch.setattr("test_model_frontends.CLOSE_BOUND_S", 0.05)
    monkeypatch.setattr(Hierarchy, "close", lambda self, timeout=None: (time_.sleep(0.1), original(self, timeout)))
    _catches(FrontMachine, "close\\(\\) took")
