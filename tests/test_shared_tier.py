"""The shared (valkey) tier in a hierarchy, on a fake server (`kvtier.testing.fake_remote`):
publish on store, find before compute (one probe per step, RETRY meanwhile, promotion), failure
is a miss (breaker, slow server, evicted or corrupted values, probes that fail or hang), and no
socket I/O on the thread that calls the manager."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from kvtier import build_hierarchy, load_config_text, make_offload_key
from kvtier.core.errors import ConfigError
from kvtier.core.types import LookupResult
from kvtier.testing.fake_remote import FakeServer
from kvtier.testing.manager import ManagerTests
from kvtier.tiers.remote.backend import ValkeyBackend

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
BLOCK = 4096


def keys(n: int, start: int = 0) -> list[bytes]:
    return [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(start, start + n)]


def content(key: bytes, salt: bytes = b"") -> bytes:
    return hashlib.shake_128(salt + key).digest(BLOCK)


@pytest.fixture
def server(monkeypatch):
    server = FakeServer()
    monkeypatch.setattr(ValkeyBackend, "store_factory", server.store)
    yield server
    server.write_gate.set()
    server.probe_gate.set()


class Engine:
    """One engine's hierarchy [memory hot, (file), valkey shared] and the calls vLLM makes."""

    def __init__(self, options: str = "", hot: int = 8, middle: str = "", url: str = "redis://fake:6379",
                 handles: int = 64):
        tiers = [f"{{name: hot, backend: memory, capacity: {hot} blocks, policy: lru}}"]
        if middle:
            tiers.append(middle)
        ttl = "" if "negative_ttl_s" in options else ", negative_ttl_s: 30"  # (a key given twice is refused)
        tiers.append(f"{{name: shared, backend: valkey, capacity: {handles} blocks, url: '{url}'{ttl}{options}}}")
        text = f"block_bytes: {BLOCK}B\ntiers:\n" + "".join(f"  - {t}\n" for t in tiers)
        self.hierarchy = build_hierarchy(load_config_text(text), model="shared-test-model")
        self.manager = self.hierarchy.manager
        self.hot = self.hierarchy.backends["hot"]
        self.shared = self.hierarchy.backends["shared"]

    def store(self, ks: list[bytes], salt: bytes = b"") -> list[bytes]:
        """Store `ks` as an engine would; "no room yet" (the next victims' copies below are still
        running: a cascading tier never evicts a block without one) is asked again after a step."""
        out = self.manager.prepare_store(ks)
        for _ in range(100):
            if out is not None:
                break
            self.settle()
            out = self.manager.prepare_store(ks)
        assert out is not None, "no room in the first tier after its copies below landed"
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            self.hot.view(slot)[:] = content(key, salt)
        self.manager.complete_store(out.keys_to_store)
        return list(out.keys_to_store)

    def load(self, ks: list[bytes]) -> list[bytes]:
        spec = self.manager.prepare_load(ks)
        data = [bytes(self.hot.view(slot)) for slot in spec.block_ids]
        self.manager.complete_load(ks)
        return data

    def settle(self, timeout: float = 10.0) -> None:
        """Step until no job, promotion or probe is pending (as an engine steps while it has work)."""
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "work still pending"
            self.manager.on_schedule_end()
            self.manager.wait_idle(5)
            time.sleep(0.001)

    def stats(self) -> dict:
        return self.manager.get_stats()["shared"]

    def close(self) -> None:
        self.hierarchy.close()


@pytest.fixture
def engines(server):
    made: list[Engine] = []

    def make(*args, **kwargs) -> Engine:
        made.append(Engine(*args, **kwargs))
        return made[-1]

    yield make
    server.write_gate.set()
    server.probe_gate.set()
    for engine in made:
        engine.close()


# A write slower than half the timeout pauses publishing (by design): tests that count writes give
# a timeout no loaded CI machine reaches, so that none is skipped for being slow.
PATIENT = ", timeout_ms: 10000"


def test_stores_are_published_once(server, engines):
    a = engines(PATIENT, hot=4)
    first = keys(4)
    a.store(first)
    a.manager.wait_idle(5)
    assert sorted(server.keys_of("kvt")) == sorted(first)
    assert a.stats()["stores"] == 4 and a.stats()["resident_blocks"] == 4
    assert {k: v for (_p, _i, k), (v, _) in server.values.items()} == {k: content(k) for k in first}  # (any order)
    a.store(keys(4, 4))  # evicts the first four from the hot tier
    a.manager.wait_idle(5)
    a.store(first)  # stored again by the engine: the server has them, nothing is sent again
    a.manager.wait_idle(5)
    assert server.calls["write_block"] == 8
    assert a.stats()["publish_dropped"] == 0


def test_another_engine_finds_the_blocks_and_loads_them_byte_identical(server, engines):
    a, b = engines(), engines()
    ks = keys(6)
    a.store(ks)
    a.manager.wait_idle(5)
    assert b.manager.lookup_run(ks) == (0, RETRY)
    assert b.manager.has_pending_work(), "keys waiting for a probe keep the engine stepping"
    b.settle()
    assert b.manager.lookup_run(ks) == (6, None)
    assert b.load(ks) == [content(k) for k in ks]
    assert server.probe_sizes == [6], "the whole run was probed in one batch"
    stats = b.stats()
    assert stats["probes"] == 1 and stats["probe_keys"] == 6 and stats["probe_hits"] == 6
    assert stats["promotions"] == 6 and stats["hits"] == 6
    assert b.manager.load_source(ks[0]) is None or b.manager.load_source(ks[0]) in ("CPU", "REMOTE")


def test_one_probe_per_step_for_every_pending_key(server, engines):
    a, b = engines(hot=16), engines(hot=16)
    ks = keys(10)
    a.store(ks[::2])
    a.manager.wait_idle(5)
    assert [b.manager.lookup(k) for k in ks] == [RETRY] * 10
    assert [b.manager.lookup(k) for k in ks] == [RETRY] * 10, "asked again before the step: no second probe"
    b.manager.on_schedule_end()
    b.settle()
    assert server.probe_sizes == [10]
    assert [b.manager.lookup(k) for k in ks] == [HIT, MISS] * 5
    assert b.load(ks[::2]) == [content(k) for k in ks[::2]]


def test_absent_keys_are_negative_cached_for_their_ttl(server, engines):
    b = engines(", negative_ttl_s: 0.3")
    k = keys(1, 100)
    assert b.manager.lookup(k[0]) == RETRY
    b.settle()
    assert b.manager.lookup(k[0]) == MISS
    b.manager.on_schedule_end()
    assert b.manager.lookup(k[0]) == MISS and server.probe_sizes == [1], "answered from the negative cache"
    time.sleep(0.35)
    assert b.manager.lookup(k[0]) == RETRY, "an expired negative answer is asked again"
    b.settle()
    assert server.probe_sizes == [1, 1]


def test_breaker_open_misses_at_once_and_drops_stores(server, engines):
    b = engines(", breaker_failures: 1, breaker_open_s: 30")
    server.down = True
    assert b.manager.lookup(keys(1)[0]) == RETRY
    b.settle()
    assert b.stats()["probe_failures"] == 1
    assert b.manager.lookup(keys(1)[0]) == MISS, "a failed probe answers MISS"
    assert not b.shared.available
    assert b.manager.lookup(keys(1, 50)[0]) == MISS, "breaker open: MISS at once, no probe queued"
    assert not b.manager.has_pending_work()
    calls = sum(server.calls.values())
    b.store(keys(3, 200))
    b.manager.wait_idle(5)
    assert sum(server.calls.values()) == calls, "nothing is sent while the breaker is open"
    assert b.stats()["publish_dropped"] == 3 and b.stats()["breaker_misses"] == 1


def test_writes_over_the_inflight_bound_are_dropped_never_waited_on(server, engines):
    a = engines(f", max_inflight_mib: {2 * BLOCK / 2**20}", hot=16)
    server.write_gate.clear()  # the server takes writes but never answers them (until set)
    started = time.monotonic()
    a.store(keys(5))
    a.store(keys(3, 5))
    assert a.manager.prepare_store(keys(2, 8)) is not None
    assert time.monotonic() - started < 2.0, "a store waited for the remote writes"
    stats = a.stats()
    assert stats["publish_dropped"] == 3 + 3
    assert server.calls["write_block"] <= 2
    server.write_gate.set()
    a.manager.wait_idle(5)
    assert len(server.values) == 2 and a.stats()["stores"] == 2


def test_a_slow_write_pauses_publishing(server, engines):
    a = engines(", timeout_ms: 100, breaker_open_s: 30", hot=16)
    server.delay_s = 0.08  # within the timeout, but over half of it: slow
    a.store(keys(1))
    a.manager.wait_idle(5)
    assert len(server.values) == 1
    a.store(keys(2, 1))
    a.manager.wait_idle(5)
    assert len(server.values) == 1 and a.stats()["publish_dropped"] == 2


def found_then(server, engines, spoil) -> tuple[Engine, bytes]:
    """Engine b finds a's key by a probe, then `spoil(key)` happens before b reads it."""
    a, b = engines(), engines()
    k = keys(1, 7)[0]
    a.store([k])
    a.manager.wait_idle(5)
    assert b.manager.lookup(k) == RETRY
    b.manager.on_schedule_end()
    deadline = time.monotonic() + 5
    while not b.shared.has_probe_results:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    spoil(k)
    assert b.manager.lookup(k) == RETRY  # found: a handle and a promotion
    b.settle()
    return b, k


@pytest.mark.parametrize("how", ["evict", "corrupt"])
def test_a_value_gone_or_corrupt_at_read_time_is_a_miss_then_recomputed(server, engines, how):
    b, k = found_then(server, engines, getattr(server, how))
    assert b.manager.lookup(k) == MISS
    assert b.manager.lookup(k) == MISS, "the key is negative-cached, not probed again"
    stats = b.stats()
    assert stats["rejected"] == 1 and stats["failures"] == 1 and stats["resident_blocks"] == 0
    assert b.manager.get_stats()["hot"]["resident_blocks"] == 0, "the promoted slot was never made readable"
    b.store([k], salt=b"recomputed")  # the engine recomputes it; the handle was dropped: published again
    b.manager.wait_idle(5)
    assert [v for v, _ in server.values.values()] == [content(k, b"recomputed")]


def test_a_probe_that_does_not_answer_in_time_is_a_miss(server, engines):
    b = engines(", timeout_ms: 50")
    server.probe_gate.clear()
    k = keys(1)[0]
    assert b.manager.lookup(k) == RETRY
    b.manager.on_schedule_end()
    assert b.manager.lookup(k) == RETRY, "within the timeout"
    time.sleep(0.06)
    assert b.manager.lookup(k) == MISS, "past the store's timeout after the step that sent it"
    b.manager.on_schedule_end()
    assert b.stats()["probe_timeouts"] == 1 and not b.manager.has_pending_work()
    server.probe_gate.set()


def test_the_file_tier_does_not_cascade_into_the_shared_tier(server, engines, tmp_path):
    middle = f"{{name: disk, backend: file, capacity: 32 blocks, root_dir: '{tmp_path}', io: posix}}"
    a = engines(PATIENT, hot=4, middle=middle)
    ks = keys(12)
    for i in range(0, 12, 2):
        a.store(ks[i:i + 2])
        a.settle()
    assert server.calls["write_block"] == 12, "each block sent once, on store; none by the cascade"
    assert a.manager.get_stats()["disk"]["stores"] > 0
    assert a.manager.lookup_run(ks[:2]) == (0, RETRY)  # in the file tier: promoted from there, not probed
    for _ in range(4):  # a run's file-tier blocks are promoted one lookup at a time
        a.settle()
        if a.manager.lookup_run(ks[:2]) == (2, None):
            break
    assert a.manager.lookup_run(ks[:2]) == (2, None) and server.probe_sizes == []
    assert a.load(ks[:2]) == [content(k) for k in ks[:2]]


def test_no_manager_call_touches_the_store_on_the_calling_thread(server, engines, monkeypatch):
    import socket

    a, b = engines(", breaker_failures: 100"), engines(", breaker_failures: 100")
    me = threading.get_ident()
    server.forbid_thread(me)
    socket_calls: list[str] = []
    for name in ("connect", "connect_ex", "send", "sendall", "recv", "recv_into"):
        original = getattr(socket.socket, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            if threading.get_ident() == me:
                socket_calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(socket.socket, name, spy)
    ks = keys(6)
    a.store(ks)
    a.settle()
    server.evict(ks[5])
    server.corrupt(ks[4])
    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.settle()
    # The corrupt value was found and read: its promotion job failed for that block alone; the
    # corrupt block is dropped and answers MISS, the four good ones were promoted.
    assert b.manager.lookup_run(ks) == (4, MISS)
    assert b.load(ks[:4]) == [content(k) for k in ks[:4]]
    assert b.stats()["rejected"] == 1
    server.down = True
    assert b.manager.lookup(keys(1, 99)[0]) == RETRY
    b.settle()
    b.store(keys(2, 300))
    b.settle()
    assert server.violations == [] and socket_calls == []


def test_one_bad_block_does_not_make_the_good_ones_of_its_promotion_miss(server, engines):
    """Regression: a promotion job failed by one corrupt block used to refuse every block of the
    job, so each good block of the request answered MISS once, one lookup at a time."""
    a, b = engines(), engines()
    ks = keys(4)
    a.store(ks)
    a.manager.wait_idle(5)
    server.corrupt(ks[2])
    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.settle()  # probed (all four found), promoted in one job, which fails for the corrupt block only
    assert b.stats()["rejected"] == 1
    assert b.manager.lookup_run(ks) == (2, MISS), "the good blocks were promoted, not refused"
    assert b.load(ks[:2]) == [content(k) for k in ks[:2]]
    assert b.manager.lookup(ks[3]) == HIT


def test_under_vllm_a_valkey_tier_gets_the_engine_identity(server):
    """vLLM builds the hierarchy without a model name: the engine's identity (model, dtype, KV
    geometry, ranks) is put into the valkey tier's fingerprint, as into a file tier's, so two
    engines of other models never share values; the start-up line names the server, not a root_dir."""
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.config import vllm_hierarchy_config
    from kvtier.integrations.vllm.logs import tier_summary

    raw = {"tiers": [{"name": "hot", "backend": "memory", "capacity": "8 blocks"},
                     {"name": "shared", "backend": "valkey", "capacity": "8 blocks", "url": "redis://h:1",
                      "fingerprint": "rev-7"}]}
    config = vllm_hierarchy_config(raw, block_tokens=16, engine_id="e", fingerprint="vllm:model=m:tp=2")
    assert config.tiers[1].options["fingerprint"] == "rev-7 | vllm:model=m:tp=2"
    with build_hierarchy(config, block_bytes=BLOCK) as hierarchy:
        assert server.stores[-1].identity.startswith("rev-7 | vllm:model=m:tp=2|")
        line = tier_summary(hierarchy, 16, BLOCK)
        assert "url=redis://h:1, key_prefix=kvt" in line and "root_dir" not in line



def test_under_vllm_a_valkey_tier_stores_one_value_per_tensor_parallel_rank(server):
    """The spec passes the engine's TP size: each valkey tier gets `tp` (its store splits a block
    into that many values); a YAML `tp` that differs from the engine's is refused, naming it."""
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.config import vllm_hierarchy_config

    def raw(**shared):
        return {"tiers": [{"name": "hot", "backend": "memory", "capacity": "8 blocks"},
                          {"name": "shared", "backend": "valkey", "capacity": "8 blocks", "url": "redis://h:1",
                           **shared}]}

    config = vllm_hierarchy_config(raw(), block_tokens=16, engine_id="e", fingerprint="m", ranks=2)
    assert config.tiers[1].options["tp"] == 2
    with build_hierarchy(config, block_bytes=BLOCK) as hierarchy:
        assert hierarchy.backends["shared"].tp == 2
    assert vllm_hierarchy_config(raw(tp=2), block_tokens=16, engine_id="e", fingerprint="m",
                                 ranks=2).tiers[1].options["tp"] == 2
    with pytest.raises(ConfigError) as info:
        vllm_hierarchy_config(raw(tp=4), block_tokens=16, engine_id="e", fingerprint="m", ranks=2)
    assert "tiers[1].tp" in dict(info.value.problems)
    with pytest.raises(ConfigError) as info:
        ValkeyBackend("r", 4, 4097, url="redis://h:1", fingerprint="m", tp=2)
    assert "tp" in dict(info.value.problems)

# ---------------------------------------------------------------------- the manager conformance suite
class FakeValkey(ValkeyBackend):
    """A valkey backend on the fake server of the running suite (`SharedTierConformance`)."""


class TestSharedTierConformance(ManagerTests):
    """`ManagerTests` on [hot memory, valkey on a fake server], with a second engine publishing
    half of the keys the driver will ask for, so lookups probe, find, promote and miss."""

    asks_others = True

    def make_manager(self, tmp_path):
        self.server = FakeServer()
        FakeValkey.store_factory = staticmethod(self.server.store)  # type: ignore[assignment]
        text = f"""
block_bytes: {BLOCK}B
tiers:
  - {{name: hot, backend: memory, capacity: 6 blocks, policy: lru}}
  - {{name: shared, backend: '{__name__}:FakeValkey', capacity: 10 blocks, url: 'redis://fake:1',
      negative_ttl_s: 0.05}}
"""
        self.hierarchy = build_hierarchy(load_config_text(text), enable_events=True, model="conformance")
        other = self.server.store({}, key_prefix="kvt", fingerprint="conformance",
                                  layout=self.hierarchy.backends["shared"].layout, block_bytes=BLOCK)
        for i in range(1000, 4000, 2):  # half of the trace's keys (`kvtier.testing.manager.make_keys`)
            other.write_block(make_offload_key((0x6D67 << 40 | i).to_bytes(8, "big"), 0), memoryview(bytes(BLOCK)))
        return self.hierarchy.manager

    def capacities(self, manager):
        return {tier.name: tier.capacity for tier in manager.tiers}


def test_wait_idle_waits_for_the_probes_in_flight(server, engines):
    """Regression: `wait_idle` returned while a probe was still running, so a caller that steps
    and waits between lookups (the standalone API) could give up with a false miss."""
    a, b = engines(), engines()
    ks = keys(3, 20)
    a.store(ks)
    a.manager.wait_idle(5)
    server.delay_s = 0.05  # every server call takes 50 ms (within the timeout)
    assert b.manager.lookup_run(ks) == (0, RETRY)
    b.manager.on_schedule_end()  # the probe goes out
    b.manager.wait_idle(5)  # its answer is taken, the promotion it queues runs and is awaited
    assert b.manager.lookup_run(ks) == (3, None)


def test_the_standalone_api_loads_another_processes_blocks(server):
    """Two `KVTier`s (two engines' KV tensors, each its own CPU tier) on one shared tier: the
    second loads what the first stored, byte-identical, through lookup -> probe -> promotion."""
    torch = pytest.importorskip("torch")
    from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    from kvtier.standalone import KVTier

    def make_kv(seed):
        g = torch.Generator().manual_seed(seed)
        tensors = [torch.randint(-128, 128, (16, 2048), dtype=torch.int8, generator=g) for _ in range(2)]
        return CanonicalKVCaches([CanonicalKVCacheTensor(t, 2048) for t in tensors],
                                 [[CanonicalKVCacheRef(0, 2048), CanonicalKVCacheRef(1, 2048)]])

    config = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks, pin: false}\n"
                              "  - {name: shared, backend: valkey, capacity: 64 blocks, url: 'redis://fake:1'}\n")
    first, second = make_kv(1), make_kv(2)
    ks = keys(5, 70)
    with KVTier.open(config, first, model="m") as a, KVTier.open(config, second, model="m") as b:
        assert a.store(ks, [3, 1, 4, 9, 2])
        a.wait()
        assert b.load(ks, [10, 11, 12, 13, 14]) == 5
        for mine, theirs in zip(second.tensors, first.tensors):
            assert torch.equal(mine.tensor[10:15], theirs.tensor[[3, 1, 4, 9, 2]])
        assert b.stats()["shared"]["hits"] == 5
