"""Write-through (`cascade: on_store`): every stored block reaches the next tier.

Copies beyond the in-flight limit wait in a queue that is retried every step and while the engine
is idle (`has_pending_work`); eviction takes written blocks only while the next tier takes copies.
A block leaves unwritten only when its copy failed or the next tier had no room, and is counted.
"""

from __future__ import annotations

import time

from conftest import keys, memory_hierarchy
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from test_manager_state import ManagerMachine

from kvtier import CPULoadStoreSpec, LookupResult, ReqContext, build_hierarchy, load_config_text
from kvtier.core.types import TransferResult
from kvtier.transfer.handlers.base import TransferHandler

BLOCK = 4096


def payload(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def cpu_over_file(root, cpu_blocks=32, file_blocks=1024):
    return build_hierarchy(load_config_text(f"""
block_bytes: {BLOCK}B
tiers:
  - {{name: cpu, backend: cpu, capacity: {cpu_blocks} blocks, policy: lru, cascade: on_store, pin: false}}
  - {{name: nvme, backend: file, root_dir: {root}, capacity: {file_blocks} blocks, policy: lru,
      fingerprint: test-model}}
"""))


def prepare(h, ks, ctx):
    """prepare_store and fill the slots (the engine's copy); the keys to complete, or None."""
    m = h.manager
    out = m.prepare_store(ks, ctx)
    if out is None:
        return None
    top = h.backends[m.tiers[0].name]
    for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
        top.view(slot)[:] = payload(key, top.block_bytes)
    return out.keys_to_store


def store(h, ks, ctx):
    """prepare_store + fill + complete_store at once; the keys stored, or None (no room)."""
    got = prepare(h, ks, ctx)
    if got is not None:
        h.manager.complete_store(got, ctx)
    return got


def idle(m, timeout=30.0, pause=0.005):
    """Step an idle engine the way vLLM does: while `has_pending_work` says so (bounded)."""
    end = time.monotonic() + timeout
    while m.has_pending_work() and time.monotonic() < end:
        m.on_schedule_end()
        time.sleep(pause)
    assert not m.has_pending_work(), "the manager kept asking for steps"


def run_requests(h, requests, per_step=2, pause=0.005, batched=False):
    """Each request stores its blocks `per_step` at a time; one scheduler step stores a slice of
    every request. A store answered None is asked again next step (as vLLM does). `batched`:
    every request's prepare_store first, then every complete_store (vLLM's order within a step)."""
    m = h.manager
    stored: list[bytes] = []
    cursors = [0] * len(requests)
    while any(c < len(r) for c, r in zip(cursors, requests)):
        prepared = []
        for i, ks in enumerate(requests):
            if cursors[i] < len(ks):
                ctx = ReqContext(f"req{i}")
                got = prepare(h, ks[cursors[i]:cursors[i] + per_step], ctx)
                if got is not None:
                    cursors[i] += per_step
                    stored += got
                    prepared.append((got, ctx))
                    if not batched:
                        m.complete_store(*prepared.pop())
        for got, ctx in prepared:
            m.complete_store(got, ctx)
        m.on_schedule_end()
        time.sleep(pause)
    return stored


def readable(tier, key) -> bool:
    block = tier.policy.get(key)
    return block is not None and block.ref_cnt >= 0


def four_requests(blocks=12):
    return [keys(blocks, start=1000 * r) for r in range(4)]


def test_cpu_over_file_write_through_keeps_every_block_and_a_restart_finds_them(tmp_path):
    """The issue's repro: 4 requests x 12 blocks, 2 per step, into a 32-block CPU tier over a
    file tier. Copies beyond the in-flight limit are deferred, then retried: all 48 reach the file
    tier, none is dropped, and a new process on the same root_dir finds every one, byte-exact."""
    h = cpu_over_file(tmp_path / "nvme")
    m = h.manager
    stored = run_requests(h, four_requests())
    idle(m)
    cpu, nvme = m.tiers
    stats = m.get_stats()["cpu"]
    assert len(stored) == 48
    assert stats["cascade_deferred"] > 0  # the limit was hit: the retry path is what is tested
    assert [k for k in stored if not readable(nvme, k)] == []
    assert stats["cascade_dropped"] == 0
    h.close()

    again = cpu_over_file(tmp_path / "nvme")
    m2 = again.manager
    assert sorted(k for k in stored if readable(m2.tiers[1], k)) == sorted(stored)
    ctx = ReqContext("after-restart")
    for key in stored[:: 7]:
        assert m2.lookup(key, ctx) is LookupResult.RETRY  # staged: promoted into the CPU tier
        m2.wait_idle()
        assert m2.lookup(key, ctx) is LookupResult.HIT
        spec = m2.prepare_load([key], ctx)
        assert bytes(again.backends["cpu"].view(spec.block_ids[0])) == payload(key, BLOCK)
        m2.complete_load([key], ctx)
    again.close()


def test_memory_tiers_write_through_keeps_every_block(ctx):
    h = memory_hierarchy(hot=32, warm=1024, cascade="on_store", reserve=0.1)
    stored = run_requests(h, four_requests(), batched=True)
    idle(h.manager)
    warm = h.manager.tiers[1]
    assert len(stored) == 48 and all(readable(warm, k) for k in stored)
    assert h.manager.get_stats()["hot"]["cascade_dropped"] == 0
    h.close()


class Gate(TransferHandler):
    """Memory copies that finish only when the test opens the gate (a slow lower tier), or fail."""

    def __init__(self, backends):
        super().__init__()
        self.backends = backends
        self.queue = []
        self.fail = False

    def submit(self, job_id, src, dst):
        self.queue.append((job_id, src, dst))

    def open(self):
        queue, self.queue = self.queue, []
        for job_id, src, dst in queue:
            if not self.fail:
                s, d = self.backends[src.tier], self.backends[dst.tier]
                for a, b in zip(src.block_ids, dst.block_ids):
                    d.view(b)[:] = s.view(a)
            self.report(TransferResult(job_id, not self.fail, 0, 0.0))


def gated(hot=8, warm=64, reserve=0.125):
    h = memory_hierarchy(hot=hot, warm=warm, cascade="on_store", reserve=reserve)
    gate = Gate(h.backends)
    h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, gate)
    return h, gate


def test_slow_lower_tier_delays_stores_instead_of_dropping_blocks():
    """Copies finish only every third step: tier 0 fills with blocks not yet written. Stores are
    then answered None (no room yet) rather than dropping them; every block ends below."""
    h, gate = gated(hot=8, warm=256)
    m = h.manager
    requests = four_requests(10)
    stored, refused, step = [], 0, 0
    cursors = [0] * 4
    while any(c < 10 for c in cursors):
        for i, ks in enumerate(requests):
            if cursors[i] < 10:
                got = store(h, ks[cursors[i]:cursors[i] + 2], ReqContext(f"req{i}"))
                refused += got is None
                if got is not None:
                    stored += got
                    cursors[i] += 2
        step += 1
        if step % 3 == 0:
            gate.open()
        m.on_schedule_end()
        assert step < 500, "stores never found room"
    while m.has_pending_work():
        gate.open()
        m.on_schedule_end()
    stats = m.get_stats()["hot"]
    assert len(stored) == 40 and refused > 0
    assert all(readable(m.tiers[1], k) for k in stored)
    assert stats["cascade_dropped"] == 0 and stats["cascade_deferred"] > 0


def test_a_written_block_is_evicted_before_one_whose_copy_waits(ctx):
    """LRU would pick the queued (unwritten) blocks first; the written ones go instead. With no
    written block left the store is refused (None) until the copies land, never dropped."""
    h, gate = gated(hot=8, warm=64, reserve=0.125)  # in-flight limit: 2 blocks
    m = h.manager
    a, c, e, g, i, k = (keys(2, start=s) for s in range(0, 12, 2))
    store(h, a, ctx)  # copy starts
    store(h, c, ctx)  # waits (limit)
    store(h, e, ctx)  # waits
    gate.open()
    store(h, g, ctx)  # drains: `a` written, `c` starts; e, g wait
    assert m.tiers[0].clean == set(a) and list(m.tiers[0].unwritten) == e + g
    m.touch(a, ctx)  # the written blocks become the most recently used
    assert store(h, i, ctx) == i
    hot = m.tiers[0]
    assert all(hot.policy.get(key) is None for key in a)  # the written ones went
    assert all(hot.policy.get(key) is not None for key in e + g)
    assert store(h, k, ctx) is None  # c in flight, e/g/i unwritten: no room yet
    assert m.has_pending_work()
    gate.open()
    m.on_schedule_end()
    assert store(h, k, ctx) == k  # `c` is written now: it makes the room
    while m.has_pending_work():
        gate.open()
        m.on_schedule_end()
    assert m.get_stats()["hot"]["cascade_dropped"] == 0
    assert all(readable(m.tiers[1], key) for key in a + c + e + g + i + k)


def test_has_pending_work_reports_copies_waiting_for_room(ctx):
    """vLLM steps an idle engine only while `has_pending_work` says so: queued copies count."""
    h, gate = gated(reserve=0.125)
    m = h.manager
    store(h, keys(2), ctx)
    store(h, keys(2, start=2), ctx)  # over the limit: queued
    gate.open()
    m.lookup(keys(1, start=99)[0], ctx)  # accounts the finished job: nothing in flight now
    assert m.tiers[0].demoting == 0 and list(m.tiers[0].unwritten) == keys(2, start=2)
    assert m.has_pending_work()
    m.on_schedule_end()  # the idle step starts them
    gate.open()
    m.on_schedule_end()
    assert not m.has_pending_work()
    assert all(readable(m.tiers[1], k) for k in keys(4))


def test_failed_lower_tier_drops_are_counted_not_silent(ctx):
    """Every copy fails: stores keep being answered (blocks whose copy failed may be evicted),
    and each such eviction is counted as cascade_dropped_failed. Once the tier heals, new blocks
    are written again."""
    h = memory_hierarchy(hot=8, warm=64, cascade="on_store", reserve=0.125)
    m = h.manager
    copier = h.router.handler_for(CPULoadStoreSpec, CPULoadStoreSpec)
    real_copy = copier.copy
    copier.copy = lambda src, dst: (_ for _ in ()).throw(OSError(5, "injected EIO"))
    failing = keys(24)
    for n in range(0, 24, 2):
        assert store(h, failing[n:n + 2], ctx) is not None
        m.on_schedule_end()
    idle(m)
    stats = m.get_stats()
    assert stats["warm"]["failures"] > 0 and stats["warm"]["resident_blocks"] == 0
    assert stats["hot"]["evictions"] == 16
    assert stats["hot"]["cascade_dropped"] == stats["hot"]["cascade_dropped_failed"] == 16
    assert stats["hot"]["cascade_dropped_full"] == 0
    copier.copy = real_copy
    healed = keys(8, start=100)
    for n in range(0, 8, 2):
        assert store(h, healed[n:n + 2], ctx) is not None
    idle(m)
    assert all(readable(m.tiers[1], k) for k in healed)
    assert m.get_stats()["hot"]["cascade_dropped"] == 24  # the 8 failed blocks left made room
    h.close()


def test_a_full_lower_tier_delays_stores_and_drops_nothing(ctx):
    """The next tier's every slot is being written by copies that do not finish: queued blocks
    cannot be written, so no store may evict them: stores are answered None (no room yet) until
    the copies land, and then every block reaches the lower tier; nothing is dropped."""
    h, gate = gated(hot=8, warm=4, reserve=0.5)  # in-flight limit 8: room is not what stops them
    m = h.manager
    store(h, keys(4), ctx)  # one copy of 4 blocks fills the lower tier, in flight
    assert m.tiers[0].demoting == 4
    stuck = keys(16, start=4)
    stored = [store(h, stuck[n:n + 2], ctx) for n in range(0, 16, 2)]
    assert stored[:2] == [stuck[:2], stuck[2:4]] and stored[2:] == [None] * 6  # tier 0 full: refused
    hot = m.get_stats()["hot"]
    assert m.tiers[0].lower_full and hot["cascade_dropped"] == 0
    assert len(m.tiers[0].unwritten) == 4  # they wait for room below
    while m.has_pending_work():
        gate.open()  # the copies land: the lower tier has room again (its blocks can be evicted)
        m.on_schedule_end()
    assert all(readable(m.tiers[1], k) for k in stuck[:4])
    assert store(h, stuck[4:6], ctx) == stuck[4:6]  # room again: the written blocks make it
    assert m.get_stats()["hot"]["cascade_dropped"] == 0


class WriteThroughMachine(ManagerMachine):
    """The manager state machine (late or failing copies, loads, failed stores) in write-through,
    with a lower tier big enough for every key: blocks leave only counted, and only as failures."""

    HIERARCHY = dict(ManagerMachine.HIERARCHY, warm=32, cascade="on_store")

    def __init__(self):
        super().__init__()
        self.failed_copies = False

    @rule(fail=st.booleans())
    def finish_transfers(self, fail):
        self.failed_copies |= fail and bool(self.copier.queue)
        self.copier.run(fail)

    @invariant()
    def drops_only_when_copies_failed(self):
        stats = self.m.tiers[0].stats
        assert stats.cascade_dropped == stats.cascade_dropped_failed + stats.cascade_dropped_full
        assert stats.cascade_dropped_full == 0  # the lower tier holds every key: never full
        if not self.failed_copies:
            assert stats.cascade_dropped == 0

    @invariant()
    def queued_blocks_are_readable_and_unwritten(self):
        hot, warm = self.m.tiers
        for key in hot.unwritten:
            block = hot.policy.get(key)
            assert block is not None and block.ref_cnt >= 0 and key not in hot.clean


TestWriteThroughMachine = WriteThroughMachine.TestCase
TestWriteThroughMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_three_tiers_writing_through_keep_every_block(ctx):
    """hot -> warm -> cold, both upper tiers `on_store`: every block reaches the last tier."""
    h = build_hierarchy(load_config_text("""
block_bytes: 64B
tiers:
  - {name: hot, backend: memory, capacity: 8 blocks, policy: lru, cascade: on_store, reserve: 0.125}
  - {name: warm, backend: memory, capacity: 8 blocks, policy: lru, cascade: on_store, reserve: 0.125}
  - {name: cold, backend: memory, capacity: 1024 blocks, policy: lru}
"""))
    gate = Gate(h.backends)
    h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, gate)
    m = h.manager
    stored, cursors = [], [0] * 4
    for _ in range(500):  # copies land at the end of each step; stores refused are asked again
        for i, ks in enumerate(four_requests()):
            if cursors[i] < len(ks) and (got := store(h, ks[cursors[i]:cursors[i] + 2], ctx)) is not None:
                stored += got
                cursors[i] += 2
        gate.open()
        m.on_schedule_end()
        if not m.has_pending_work() and min(cursors) == 12:
            break
    stats = m.get_stats()
    assert len(stored) == 48 and all(readable(h.manager.tiers[2], k) for k in stored)
    assert stats["hot"]["cascade_dropped"] == stats["warm"]["cascade_dropped"] == 0
    h.close()


def test_a_flush_finding_no_room_below_keeps_the_blocks_queued(ctx):
    """`flush` with every slot below pinned starts nothing and reports the blocks left; they stay
    in the write-through queue, so they are written once the next tier has room again."""
    h, gate = gated(hot=8, warm=4, reserve=0.5)
    m = h.manager
    store(h, keys(4), ctx)
    gate.open()
    m.on_schedule_end()
    warm = m.tiers[1]
    for key in keys(4):  # the lower tier's every block pinned (as a copy out of it would): no room there
        warm.policy.get(key).ref_cnt += 1
    warm.policy.evictable(keys(4), False)
    waiting = keys(2, start=4)
    store(h, waiting, ctx)
    assert list(m.tiers[0].unwritten) == waiting and m.tiers[0].lower_full
    assert m.flush(timeout=5) == 2
    assert list(m.tiers[0].unwritten) == waiting
    for key in keys(4):
        warm.policy.get(key).ref_cnt -= 1
    warm.policy.evictable(keys(4), True)
    store(h, keys(2, start=6), ctx)  # the queue is tried again, oldest first
    while m.has_pending_work():
        gate.open()
        m.on_schedule_end()
    assert all(readable(warm, k) for k in waiting)
    assert m.get_stats()["hot"]["cascade_dropped"] == 0
