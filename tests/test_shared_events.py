"""KV events of the shared (valkey) tier follow residence: a block the server did not take is never
reported stored there, nor counted in `stores` (only in `publish_dropped`).

Every way a publish can fail to land (docs/shared-tier.md, failure table) is driven on a fake server
(`kvtier.testing.fake_remote`): a refused write (full server), a write failing mid-job, a slow
write pausing the rest, a job past its deadline, the breaker open, the in-flight bound. After
each, replaying the events must give, per tier, exactly the resident blocks (stored - removed ==
`resident_blocks`, no removal of a block not stored, the shared tier's blocks all on the server).
A file tier's failed demotion writes are held to the same (no `stored` for them)."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from conftest import keys

from kvtier import CPULoadStoreSpec, build_hierarchy, load_config_text
from kvtier.testing.fake_remote import FakeServer, FakeStore, RemoteUnavailable
from kvtier.tiers.file.spec import FileLoadStoreSpec
from kvtier.tiers.remote.backend import ValkeyBackend
from kvtier.transfer.handlers.base import SyncHandler

BLOCK = 4096


@pytest.fixture
def server(monkeypatch):
    server = FakeServer()
    monkeypatch.setattr(ValkeyBackend, "store_factory", server.store)
    yield server
    server.write_gate.set()


@pytest.fixture
def made():
    hierarchies: list = []
    yield hierarchies
    for h in hierarchies:
        h.close()


def hierarchy(made: list, shared: str | None = "", middle: str = "", hot: int = 8):
    """[memory hot, (middle), valkey shared with options `shared` (None: none)], events on."""
    tiers = [f"{{name: hot, backend: memory, capacity: {hot} blocks, policy: lru}}"]
    if middle:
        tiers.append(middle)
    if shared is not None:
        tiers.append(f"{{name: shared, backend: valkey, capacity: 64 blocks, url: 'redis://fake:6379'{shared}}}")
    text = f"block_bytes: {BLOCK}B\ntiers:\n" + "".join(f"  - {t}\n" for t in tiers)
    made.append(build_hierarchy(load_config_text(text), model="events-model", enable_events=True))
    return made[-1]


def store(h, ks: list[bytes]) -> None:
    """Store `ks` as an engine would (asking again after a step while the first tier has no room)."""
    m = h.manager
    for _ in range(200):
        out = m.prepare_store(ks)
        if out is not None:
            m.complete_store(out.keys_to_store)
            m.wait_idle(5)
            return
        m.on_schedule_end()
        m.wait_idle(5)
    raise AssertionError("no room in the first tier")


class Residence:
    """The blocks each tier holds according to the events taken so far (replayed in order)."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = defaultdict(set)
        self.stored: dict[str, list[bytes]] = defaultdict(list)
        self.removed: dict[str, list[bytes]] = defaultdict(list)

    def take(self, h) -> None:
        for event in h.manager.take_events():
            held = self.held[event.tier]
            for key in map(bytes, event.keys):
                if event.removed:
                    assert key in held, f"{event.tier}: removed {key.hex()}, never reported stored"
                    held.discard(key)
                    self.removed[event.tier].append(key)
                else:
                    assert key not in held, f"{event.tier}: {key.hex()} reported stored twice"
                    held.add(key)
                    self.stored[event.tier].append(key)

    def check(self, h, server: FakeServer | None = None) -> None:
        """stored - removed == resident blocks, per tier; the shared tier's blocks are on the server."""
        self.take(h)
        stats = h.manager.get_stats()
        for tier in (t.name for t in h.manager.tiers):
            resident = stats[tier]["resident_blocks"]
            assert len(self.stored[tier]) - len(self.removed[tier]) == len(self.held[tier]) == resident, tier
        if server is not None:
            assert self.held["shared"] <= set(server.keys_of()), "a block reported stored is not on the server"


def refuse(monkeypatch, server: FakeServer, refused=lambda key: True) -> None:
    """Writes of keys where `refused(key)` fail as a full server's do (OOM); the others land."""
    write = FakeStore.write_block

    def write_block(self, key, block, deadline=None):
        if refused(bytes(key)):
            server.record_call("write_block")
            raise RemoteUnavailable("OOM command not allowed when used memory > 'maxmemory'", "OutOfMemoryError")
        return write(self, key, block, deadline)

    monkeypatch.setattr(FakeStore, "write_block", write_block)


def shared_stats(h) -> dict:
    return h.manager.get_stats()["shared"]


def test_refused_writes_are_never_reported_stored(server, made, monkeypatch):
    refuse(monkeypatch, server)
    h, seen = hierarchy(made, ", timeout_ms: 10000"), Residence()
    ks = keys(4)
    store(h, ks)
    seen.check(h, server)
    assert not seen.stored["shared"] and not seen.removed["shared"], "no event for blocks never held"
    assert sorted(seen.stored["hot"]) == sorted(ks)
    stats = shared_stats(h)
    assert (stats["stores"], stats["publish_dropped"], stats["resident_blocks"], stats["bytes_in"]) == (0, 4, 0, 0)
    assert not server.values


def test_a_write_failing_mid_job_reports_only_the_blocks_written(server, made, monkeypatch):
    ks = keys(5)
    refuse(monkeypatch, server, lambda key: key == ks[2])
    h, seen = hierarchy(made, ", timeout_ms: 10000, threads: 1"), Residence()  # (one job: in order)
    store(h, ks)
    seen.check(h, server)
    assert sorted(seen.stored["shared"]) == sorted(ks[:2]) and not seen.removed["shared"]
    stats = shared_stats(h)
    assert (stats["stores"], stats["publish_dropped"], stats["resident_blocks"]) == (2, 3, 2)
    assert stats["bytes_in"] == 2 * BLOCK
    assert sorted(server.keys_of()) == sorted(ks[:2])


def test_a_slow_write_reports_the_written_block_only(server, made):
    h, seen = hierarchy(made, ", timeout_ms: 400, threads: 1, breaker_open_s: 30", hot=16), Residence()
    server.delay_s = 0.25  # within the timeout, over half of it: slow, the rest of the job is paused
    ks = keys(3)
    store(h, ks)
    server.delay_s = 0.0
    store(h, keys(2, 3))  # publishing paused: not sent, no handle
    seen.check(h, server)
    assert seen.stored["shared"] == [ks[0]] and not seen.removed["shared"]
    stats = shared_stats(h)
    assert (stats["stores"], stats["publish_dropped"], stats["resident_blocks"]) == (1, 2 + 2, 1)


def test_a_job_past_its_deadline_reports_no_block_it_did_not_write(server, made):
    h, seen = hierarchy(made, ", timeout_ms: 200, threads: 1, breaker_open_s: 30"), Residence()
    server.write_gate.clear()  # the first write hangs past the job's deadline
    ks = keys(3)
    out = h.manager.prepare_store(ks)
    h.manager.complete_store(out.keys_to_store)
    time.sleep(0.3)
    server.write_gate.set()
    h.manager.wait_idle(5)
    seen.check(h, server)
    written = set(server.keys_of())
    assert set(seen.stored["shared"]) == written and len(written) <= 1 and not seen.removed["shared"]
    stats = shared_stats(h)
    assert stats["stores"] == len(written) and stats["publish_dropped"] == 3 - len(written)


def test_breaker_open_and_a_down_server_report_nothing_stored(server, made):
    h, seen = hierarchy(made, ", breaker_failures: 1, breaker_open_s: 30, threads: 1"), Residence()
    server.down = True
    store(h, keys(3))  # the first write fails: the job's blocks stay unsent
    store(h, keys(2, 3))  # paused / breaker open: not sent at all
    seen.check(h, server)
    assert not seen.stored["shared"] and not seen.removed["shared"]
    stats = shared_stats(h)
    assert (stats["stores"], stats["publish_dropped"], stats["resident_blocks"]) == (0, 5, 0)


def test_blocks_over_the_inflight_bound_are_not_reported_stored(server, made):
    h, seen = hierarchy(made, f", max_inflight_mib: {2 * BLOCK / 2**20}, timeout_ms: 10000", hot=16), Residence()
    server.write_gate.clear()
    out = h.manager.prepare_store(keys(5))
    h.manager.complete_store(out.keys_to_store)
    server.write_gate.set()
    h.manager.wait_idle(5)
    seen.check(h, server)
    assert len(seen.stored["shared"]) == 2 and not seen.removed["shared"]
    stats = shared_stats(h)
    assert (stats["stores"], stats["publish_dropped"], stats["resident_blocks"]) == (2, 3, 2)


class FailingFileWrites(SyncHandler):
    """Every copy into the file tier fails (a full disk)."""

    def copy(self, src, dst):
        raise OSError(28, "No space left on device")


def test_failed_file_demotions_are_never_reported_stored(tmp_path, made):
    middle = f"{{name: nvme, backend: file, root_dir: '{tmp_path}', capacity: 16 blocks, policy: lru}}"
    h, seen = hierarchy(made, middle=middle, hot=2, shared=None), Residence()
    h.router.register(CPULoadStoreSpec, FileLoadStoreSpec, FailingFileWrites())
    store(h, keys(2))
    store(h, keys(2, 2))  # the first two are copied down, fail, then are evicted
    seen.check(h)
    assert not seen.stored["nvme"] and not seen.removed["nvme"]
    stats = h.manager.get_stats()
    assert stats["nvme"]["stores"] == 0 and stats["nvme"]["failures"] == 2
    assert stats["hot"]["cascade_dropped_failed"] == 2
