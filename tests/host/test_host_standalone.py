"""Engines of one model share the host owner's hierarchy (`shared: host`): blocks stored by one are
loaded byte-identical by another, other identities see nothing, and an owner that dies, hangs or
restarts is a miss within `timeout_ms`, never a stall or a wrong byte."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from host.owner_process import OwnerProcess

from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, load_config_text, make_offload_key
from kvtier.core.errors import ArgumentError
from kvtier.host.client import HostRefused
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")

PAGE = 4096
TIMEOUT_MS = 200


def make_kv(num_blocks=32, page=PAGE, seed=2):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=g) for _ in range(2)]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                             [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])


def keys(n, start=0):
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(start, start + n)]


def same_blocks(a, b, n):
    return all(torch.equal(x.tensor[:n], y.tensor[:n]) for x, y in zip(a.tensors, b.tensors))


def wipe(kv):
    for t in kv.tensors:
        t.tensor.zero_()


def shared_config(tmp_path, cpu_blocks=8, file_blocks=64, timeout_ms=TIMEOUT_MS, file_tier=True):
    file = f"\n  - {{name: nvme, backend: file, root_dir: {tmp_path}/nvme, capacity: {file_blocks} blocks}}"
    return load_config_text(f"""
shared: {{scope: host, socket: {tmp_path}/run/host.sock, timeout_ms: {timeout_ms}}}
tiers:
  - {{name: cpu, backend: cpu, capacity: {cpu_blocks} blocks}}{file if file_tier else ""}
""")


@pytest.fixture
def owner(tmp_path):
    proc = OwnerProcess(f"{tmp_path}/run/host.sock", tmp_path / "owner.log").start()
    yield proc
    proc.stop()


@pytest.fixture
def model():
    return f"test-model-{uuid.uuid4().hex[:8]}"  # a namespace of its own (its region's name is the identity's)


def test_a_block_stored_by_one_engine_is_loaded_byte_identical_by_another(tmp_path, owner, model):
    a_kv, b_kv = make_kv(seed=1), make_kv(seed=9)
    config = shared_config(tmp_path)
    with KVTier.open(config, a_kv, model=model) as a, KVTier.open(config, b_kv, model=model) as b:
        assert a.store(keys(20), list(range(20)))
        assert b.lookup(keys(20)) == 20  # (8 in the CPU tier, the rest below: brought up by load)
        assert b.load(keys(20), list(range(20))) == 20
        assert same_blocks(a_kv, b_kv, 20)
        tiers = b.stats()
        assert tiers["cpu"]["capacity_blocks"] == 8 and tiers["engine"]["loads"] == 20


def test_another_process_loads_what_this_one_stored(tmp_path, owner, model):
    a_kv = make_kv(seed=1)
    config = shared_config(tmp_path)
    with KVTier.open(config, a_kv, model=model) as a:
        assert a.store(keys(6), list(range(6)))
        script = textwrap.dedent(f"""
            import sys, torch
            sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
            from host.test_host_standalone import make_kv, keys, shared_config, wipe
            from pathlib import Path
            from kvtier.standalone import KVTier
            kv = make_kv(seed=5)
            wipe(kv)
            with KVTier.open(shared_config(Path({str(tmp_path)!r})), kv, model={model!r}) as b:
                n = b.load(keys(6), list(range(6)))
            torch.save([t.tensor[:6].clone() for t in kv.tensors], {str(tmp_path / 'b.pt')!r})
            print("loaded", n)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "loaded 6" in out.stdout
        loaded = torch.load(tmp_path / "b.pt")
        assert all(torch.equal(t.tensor[:6], got) for t, got in zip(a_kv.tensors, loaded))


def test_engines_of_another_model_or_layout_see_nothing(tmp_path, owner, model):
    config = shared_config(tmp_path)
    with KVTier.open(config, make_kv(), model=model) as a:
        assert a.store(keys(4), list(range(4)))
        with KVTier.open(config, make_kv(), model=model + "-other") as other_model:
            assert other_model.lookup(keys(4)) == 0
        with KVTier.open(config, make_kv(page=2048), model=model) as other_layout:
            assert other_layout.lookup(keys(4)) == 0
        with KVTier.open(config, make_kv(), model=model) as same:
            assert same.lookup(keys(4)) == 4


def test_an_engine_asking_for_other_tiers_of_the_same_model_is_refused(tmp_path, owner, model):
    with KVTier.open(shared_config(tmp_path), make_kv(), model=model):
        with pytest.raises(HostRefused, match="tiers"):
            KVTier.open(shared_config(tmp_path, cpu_blocks=16), make_kv(), model=model)


def test_joining_needs_a_model(tmp_path, owner):
    with pytest.raises(ValueError, match="model: required with shared: host"):
        KVTier.open(shared_config(tmp_path), make_kv())


@pytest.mark.parametrize("option", [{"metrics_port": 0}, {"enable_events": True}])
def test_options_for_a_hierarchy_of_its_own_are_refused_with_a_shared_one(tmp_path, option):
    """Before: `metrics_port` and the build options were dropped without a word (no endpoint,
    no events) when the YAML said `shared: host`."""
    with pytest.raises(ArgumentError, match=f"^{next(iter(option))}: not with 'shared: host'"):
        KVTier.open(shared_config(tmp_path), make_kv(), model="m", **option)


def _timed(call):
    start = time.monotonic()
    value = call()
    return value, time.monotonic() - start


def test_a_killed_owner_is_a_miss_and_a_restarted_one_serves_its_file_tier(tmp_path, owner, model):
    a_kv, b_kv = make_kv(seed=1), make_kv(seed=3)
    config = shared_config(tmp_path)
    with KVTier.open(config, a_kv, model=model) as a, KVTier.open(config, b_kv, model=model) as b:
        assert a.store(keys(20), list(range(20)))
        owner.kill()
        for call in (lambda: b.lookup(keys(20)), lambda: b.load(keys(20), list(range(20)))):
            value, seconds = _timed(call)
            assert value == 0 and seconds < TIMEOUT_MS / 1000 + 0.5
        stored, seconds = _timed(lambda: a.store(keys(4, start=100), list(range(4))))
        assert stored is False and seconds < TIMEOUT_MS / 1000 + 0.5
        owner.start()
        time.sleep(1.1)  # (the clients' backoff after the failure)
        wipe(b_kv)
        # The first 12 were copied down to the file tier as the 8-block CPU tier filled (and maybe a
        # few more ahead, by the reserve's background copies); a restarted owner starts its CPU
        # tier empty, so what lived only there is gone.
        loaded = b.load(keys(20), list(range(20)))
        assert loaded >= 12 and same_blocks(a_kv, b_kv, loaded)
    assert "recovered" in owner.log()


def test_a_hung_owner_costs_one_deadline_then_misses_at_once(tmp_path, owner, model):
    config = shared_config(tmp_path, timeout_ms=100)
    with KVTier.open(config, make_kv(), model=model) as a:
        assert a.store(keys(4), list(range(4)))
        owner.pause()
        try:
            hits, first = _timed(lambda: a.lookup(keys(4)))
            assert hits == 0 and 0.09 < first < 0.6
            hits, second = _timed(lambda: a.lookup(keys(4)))
            assert hits == 0 and second < 0.05  # (the backoff: no socket touched)
        finally:
            owner.resume()
        time.sleep(1.1)
        assert a.lookup(keys(4)) == 4  # the same connection: its late answer is skipped


def test_stopping_the_owner_writes_its_cpu_tier_down(tmp_path, owner, model):
    kv = make_kv()
    config = shared_config(tmp_path, cpu_blocks=16)
    with KVTier.open(config, kv, model=model) as a:
        assert a.store(keys(8), list(range(8)))  # (all in the CPU tier: nothing copied below yet)
    owner.stop()
    owner.start()
    with KVTier.open(config, make_kv(seed=7), model=model) as b:
        assert b.lookup(keys(8)) == 8


def test_a_restarted_owner_slower_to_answer_than_timeout_ms_never_serves_another_regions_bytes(tmp_path, owner,
                                                                                                 model):
    """The restarted owner rebuilds the namespace (file tier recovery) at the engine's first hello, taking
    longer than timeout_ms=20: that hello times out, and its late answer must not leave the engine
    copying from the dead owner's region with the new owner's slot numbers."""
    a_kv, b_kv = make_kv(seed=1), make_kv(seed=3)
    config = shared_config(tmp_path, timeout_ms=20)
    with KVTier.open(config, a_kv, model=model) as a, KVTier.open(config, b_kv, model=model) as b:
        assert a.store(keys(20), list(range(20)))
        owner.kill()
        owner.start()
        deadline, loaded = time.monotonic() + 20, 0
        while loaded < 12 and time.monotonic() < deadline:  # (12 or more are in the file tier: see above)
            wipe(b_kv)
            loaded = b.load(keys(20), list(range(20)))
            assert same_blocks(a_kv, b_kv, loaded)
            time.sleep(0.2)
        assert loaded >= 12


@pytest.mark.parametrize("hinted", [True, False])
def test_a_sessions_retention_hint_keeps_its_blocks_for_every_engine(tmp_path, owner, model, hinted):
    config = shared_config(tmp_path, cpu_blocks=16, file_tier=False)
    hints = {"session": "chat-1", "retain_s": 600} if hinted else None
    with KVTier.open(config, make_kv(), model=model) as a, KVTier.open(config, make_kv(), model=model) as b:
        assert a.store(keys(4), list(range(4)), hints=hints)
        for start in range(100, 164, 8):  # another engine's traffic: 64 blocks through a 16-block tier
            b.store(keys(8, start), list(range(8)))
        assert b.lookup(keys(4)) == (4 if hinted else 0)


def test_a_bad_hint_is_refused_before_the_owner_is_asked(tmp_path, owner, model):
    with KVTier.open(shared_config(tmp_path), make_kv(), model=model) as a:
        with pytest.raises(ValueError, match="hints"):
            a.store(keys(2), [0, 1], hints={"session": "s", "retain_s": "forever"})
        assert a.lookup(keys(2)) == 0


def test_sigterm_stops_a_serving_owner_promptly_every_time(tmp_path, owner, model):
    """The kernel may deliver SIGTERM to any of the owner's threads: the main thread still acts on
    it within its wait slice (it used to wait without a timeout and could miss it for good)."""
    for _ in range(4):
        with KVTier.open(shared_config(tmp_path), make_kv(), model=model) as a:
            assert a.store(keys(4), list(range(4)))
            start = time.monotonic()
            log = owner.stop(timeout=10)
            assert time.monotonic() - start < 10 and "kvtier serve: stopped" in log
        owner.start()


def test_a_lookup_counts_blocks_below_without_waiting_for_a_refused_promotion(tmp_path, owner, model):
    """The owner's first tier is all pinned by another engine's load, so it refuses to promote the
    blocks a lookup finds in the file tier: the lookup counts them at once (`load` brings them up
    in rounds), never waiting for room as a load does."""
    from kvtier.host.wire import hex_keys
    from kvtier.standalone.shared import REFUSED_WAIT_S

    config = shared_config(tmp_path, cpu_blocks=4)
    with KVTier.open(config, make_kv(seed=1), model=model) as a, KVTier.open(config, make_kv(seed=9), model=model) as b:
        assert a.store(keys(12), list(range(12)))
        assert a.client.call("lookup_run", keys=hex_keys(keys(4, start=8)))["hits"] == 4  # the last 4 in the CPU tier
        assert len(a.client.call("prepare_load", keys=hex_keys(keys(4, start=8)))["slots"]) == 4  # pinned by a
        answers, call = [], b.client.call

        def recorded(op, **arguments):
            answer = call(op, **arguments)
            answers.append((op, answer.get("next"), answer.get("held")))
            return answer

        b.client.call = recorded
        started = time.monotonic()
        assert b.lookup(keys(4)) == 4
        waited = time.monotonic() - started
        # The lookup asks again only while the owner is still deciding (RETRY, HIT_PENDING: a
        # promotion started or queued while copies down make room, however long those take) and
        # stops at its first other answer, here the refusal that counts the blocks held below.
        nexts = [nxt for op, nxt, _ in answers if op == "lookup_run"]
        assert nexts and nexts[-1] not in ("RETRY", "HIT_PENDING"), answers
        assert all(nxt in ("RETRY", "HIT_PENDING") for nxt in nexts[:-1]), answers
        assert answers[-1][2] == 4, answers
        assert waited < REFUSED_WAIT_S, f"the lookup waited {waited:.2f} s (answers: {answers})"
