"""The shared-memory CPU region across processes: ownership, identity, and nothing left behind.

Threats: a second kvtier instance (another vLLM engine) given the same region name, also after
the first one removed its region's name (vLLM's in-process worker: at once); a worker mapping a
region its scheduler did not create; a normal stop (SIGTERM) or a SIGKILL leaving the region (the
CPU tier's full size) in /dev/shm. Regions are created in a private directory (`cpu.SHM_DIR`)
except for the vLLM spec tests, which use /dev/shm with names of their own.

The name of region <name> is held for its owner's life by the claim <name>.kvtier-claim (spelled
out here, so that the code before claims fails on behaviour, not on a missing attribute).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier import ConfigError, load_config_text
from kvtier.tiers.cpu import backend as cpu

PATTERN = bytes(range(256)) * 16  # one 4096-byte block
CLAIM = ".kvtier-claim"

# A child that creates a region in argv[1] (named argv[2], or generated when "-"), fills slot 0 with
# PATTERN, removes the region's name if argv[3] is "unpublish" (as under vLLM once the worker mapped
# it), prints "<name> <pid> <token>", then on each stdin line prints whether slot 0 is intact.
OWNER = textwrap.dedent("""
    import os, sys
    from kvtier.tiers.cpu import backend as cpu
    cpu.SHM_DIR = sys.argv[1]
    name = None if sys.argv[2] == "-" else sys.argv[2]
    pattern = bytes(range(256)) * 16
    backend = cpu.CPUBackend("cpu", 4, 4096, shm_name=name, pin=False)
    backend.view(0)[:] = pattern
    if sys.argv[3] == "unpublish":
        backend.unpublish()
    print(backend.shm_name, os.getpid(), getattr(backend, "token", "-"), flush=True)
    for line in sys.stdin:
        print("intact" if bytes(backend.view(0)) == pattern else "changed", flush=True)
""")


class Owner:
    """A child process owning one region (see OWNER)."""

    def __init__(self, shm_dir, name="-", unpublish=False):
        self.proc = subprocess.Popen([sys.executable, "-c", OWNER, str(shm_dir), name,
                                      "unpublish" if unpublish else "keep"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        assert len(line) == 3, self.proc.stderr.read()
        self.name, self.token = line[0], line[2]
        assert int(line[1]) == self.proc.pid

    def slot0_intact(self) -> bool:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip() == "intact"

    def kill(self, sig=signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()
        return code


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(cpu, "SHM_DIR", str(d))
    return d


def test_second_creator_of_a_live_regions_name_is_refused_with_the_owners_pid(shm_dir):
    """Two instances, one name: the second is refused (the first's pid in the message); the first's
    region is neither removed nor reused, its bytes intact."""
    owner = Owner(shm_dir, "kvtier-engine-a-cpu")
    try:
        with pytest.raises(cpu.RegionInUseError, match=f"region kvtier-engine-a-cpu is in use by pid {owner.proc.pid}"):
            cpu.CPUBackend("cpu", 4, 4096, shm_name="kvtier-engine-a-cpu", pin=False)
        # nothing else left by the refused build
        assert sorted(os.listdir(shm_dir)) == ["kvtier-engine-a-cpu", "kvtier-engine-a-cpu" + CLAIM]
        assert owner.slot0_intact()
        peer = cpu.CPUBackend.attach("kvtier-engine-a-cpu", 4, 4096, pin=False, token=owner.token)
        try:
            assert bytes(peer.view(0)) == PATTERN
        finally:
            peer.close()
    finally:
        owner.kill()


def test_second_creator_is_refused_after_the_owner_removed_its_regions_name(shm_dir):
    """Under vLLM's in-process worker the region's name is removed at once; the name is still the
    owner's: a second creator (another process) is refused with the owner's pid, nothing of it is
    left behind, and the owner's bytes are intact."""
    owner = Owner(shm_dir, "kvtier-engine-a-cpu", unpublish=True)
    try:
        with pytest.raises(cpu.RegionInUseError, match=f"region kvtier-engine-a-cpu is in use by pid {owner.proc.pid}"):
            cpu.CPUBackend("cpu", 4, 4096, shm_name="kvtier-engine-a-cpu", pin=False)
        assert os.listdir(shm_dir) == ["kvtier-engine-a-cpu" + CLAIM]
        assert owner.slot0_intact()
    finally:
        owner.kill()


CONTENDER = textwrap.dedent("""
    import sys
    from kvtier.tiers.cpu import backend as cpu
    cpu.SHM_DIR = sys.argv[1]
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        backend = cpu.CPUBackend("cpu", 4, 4096, shm_name="kvtier-race-cpu", pin=False)
        backend.unpublish()
        print("won", flush=True)
    except cpu.RegionInUseError as exc:
        print("refused", exc, flush=True)
    sys.stdin.readline()
""")


def test_of_creators_racing_for_one_name_exactly_one_wins(shm_dir):
    """Four processes create the same name at once, each removing its region's name as soon as it
    has it: one wins, the others are refused naming the winner, whatever the interleaving."""
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(shm_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = {p.pid: p.stdout.readline().strip() for p in procs}
        winners = [pid for pid, line in results.items() if line == "won"]
        assert len(winners) == 1, results
        for pid, line in results.items():
            if pid != winners[0]:
                assert line.startswith(f"refused region kvtier-race-cpu is in use by pid {winners[0]}"), results
        assert os.listdir(shm_dir) == ["kvtier-race-cpu" + CLAIM]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=60)
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()


def test_a_sigkilled_owners_claim_is_reclaimed_at_once(shm_dir):
    """A SIGKILL after the region's name was removed leaves only the claim; the next creator of the
    name takes it over at once (no waiting for the sweep's minimum age)."""
    dead = Owner(shm_dir, "kvtier-restart-cpu", unpublish=True)
    assert dead.kill() == -signal.SIGKILL
    assert os.listdir(shm_dir) == ["kvtier-restart-cpu" + CLAIM]
    b = cpu.CPUBackend("cpu", 4, 4096, shm_name="kvtier-restart-cpu", pin=False)
    try:
        assert sorted(os.listdir(shm_dir)) == ["kvtier-restart-cpu", "kvtier-restart-cpu" + CLAIM]
        claim = (shm_dir / ("kvtier-restart-cpu" + CLAIM)).read_text()
        assert f"pid {os.getpid()}" in claim and str(dead.proc.pid) not in claim
    finally:
        b.close()
    assert os.listdir(shm_dir) == []


def test_the_sweep_removes_dead_owners_claims_and_keeps_live_ones(shm_dir):
    live = Owner(shm_dir, "team-a-cache", unpublish=True)
    dead = Owner(shm_dir, "team-b-cache", unpublish=True)
    (shm_dir / ("notes" + CLAIM)).write_bytes(b"looks like a claim, is not one")
    try:
        assert dead.kill() == -signal.SIGKILL
        assert cpu.remove_stale_regions(str(shm_dir), min_age_s=3600) == []  # too young
        assert cpu.remove_stale_regions(str(shm_dir), min_age_s=0) == ["team-b-cache" + CLAIM]
        assert sorted(os.listdir(shm_dir)) == ["notes" + CLAIM, "team-a-cache" + CLAIM]
        assert (shm_dir / ("notes" + CLAIM)).read_bytes() == b"looks like a claim, is not one"
        with pytest.raises(cpu.RegionInUseError, match=f"in use by pid {live.proc.pid}"):
            cpu.CPUBackend("cpu", 4, 4096, shm_name="team-a-cache", pin=False)
        assert live.slot0_intact()
    finally:
        live.kill()


@pytest.mark.parametrize("planted", ["file", "symlink", "fifo"])
def test_a_planted_claim_is_neither_taken_over_nor_followed(shm_dir, tmp_path, planted):
    """Whatever sits at a region's claim without being a kvtier claim of this user refuses the name
    and is left as it is (a symlink's target is never opened)."""
    target = tmp_path / "precious"
    target.write_bytes(b"precious")
    claim = shm_dir / ("mine" + CLAIM)
    if planted == "file":
        claim.write_bytes(b"precious")
    elif planted == "symlink":
        claim.symlink_to(target)
    else:
        os.mkfifo(claim)
    with pytest.raises(cpu.RegionInUseError, match="mine.kvtier-claim exists"):
        cpu.CPUBackend("cpu", 1, 4096, shm_name="mine", pin=False)
    assert os.listdir(shm_dir) == ["mine" + CLAIM] and target.read_bytes() == b"precious"
    if planted == "file":
        assert claim.read_bytes() == b"precious"


def test_a_dead_owners_region_is_swept_whatever_its_name(shm_dir):
    """A SIGKILLed owner's regions go at the next sweep, whatever they are called (a name without the
    kvtier- prefix, one whose pid field names a live process); live regions and files that are not
    kvtier regions stay. Their claims go with them."""
    live = Owner(shm_dir, "team-a-cache")
    dead = [Owner(shm_dir, "team-b-cache"), Owner(shm_dir, "kvtier-1-cpu"), Owner(shm_dir)]  # pid 1 is alive
    (shm_dir / "notes.txt").write_bytes(b"not a region")
    try:
        for owner in dead:
            assert owner.kill() == -signal.SIGKILL
        assert cpu.remove_stale_regions(str(shm_dir), min_age_s=3600) == []  # too young: maybe being created
        removed = cpu.remove_stale_regions(str(shm_dir), min_age_s=0)
        assert sorted(removed) == sorted([o.name for o in dead] + [o.name + CLAIM for o in dead])
        assert sorted(os.listdir(shm_dir)) == ["notes.txt", "team-a-cache", "team-a-cache" + CLAIM]
        assert live.slot0_intact()
    finally:
        live.kill()
    assert sorted(cpu.remove_stale_regions(str(shm_dir), min_age_s=0)) == ["team-a-cache", "team-a-cache" + CLAIM]


def test_a_name_left_by_a_dead_owner_is_reclaimed_at_once(shm_dir):
    """Restarting with the same shm_name after a crash works: the dead owner's region is replaced."""
    dead = Owner(shm_dir, "kvtier-restart-cpu")
    dead.kill()
    b = cpu.CPUBackend("cpu", 4, 4096, shm_name="kvtier-restart-cpu", pin=False)
    try:
        assert b.owner_pid() == os.getpid() and bytes(b.view(0)) == bytes(4096)
        assert sorted(os.listdir(shm_dir)) == ["kvtier-restart-cpu", "kvtier-restart-cpu" + CLAIM]
    finally:
        b.close()
    assert os.listdir(shm_dir) == []


def test_a_file_that_is_not_a_region_is_never_taken_over(shm_dir):
    (shm_dir / "mydata").write_bytes(b"precious")
    with pytest.raises(cpu.RegionInUseError, match="not a kvtier region"):
        cpu.CPUBackend("cpu", 1, 4096, shm_name="mydata", pin=False)
    assert (shm_dir / "mydata").read_bytes() == b"precious"
    assert os.listdir(shm_dir) == ["mydata"]


@pytest.mark.parametrize("unpublish", [False, True], ids=["named", "unpublished"])
@pytest.mark.parametrize("name", ["-", "my-region"])
def test_sigterm_leaves_neither_region_nor_claim(shm_dir, name, unpublish):
    """Python's default SIGTERM runs no finalizer; the region and its claim are removed anyway and
    the process still dies of SIGTERM. The name is free again at once."""
    owner = Owner(shm_dir, name, unpublish=unpublish)
    try:
        assert sorted(os.listdir(shm_dir)) == ([] if unpublish else [owner.name]) + [owner.name + CLAIM]
    finally:
        code = owner.kill(signal.SIGTERM)
    assert code == -signal.SIGTERM
    assert os.listdir(shm_dir) == []
    cpu.CPUBackend("cpu", 4, 4096, shm_name=owner.name, pin=False).close()


def test_a_forked_child_never_removes_its_parents_region(shm_dir):
    """A child forked after the region exists inherits the handlers, not the ownership: its SIGTERM
    or its normal exit leave the parent's region in place."""
    b = cpu.CPUBackend("cpu", 2, 4096, pin=False)
    try:
        for how in ("sigterm", "exit"):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # child
                os.close(read)
                if how == "exit":
                    b.close()  # runs what its exit would run (the region's finalizer)
                    os._exit(0)
                os.write(write, b"x")
                time.sleep(60)
                os._exit(1)
            os.close(write)
            if how == "sigterm":
                assert os.read(read, 1) == b"x"
                os.kill(pid, signal.SIGTERM)
            _, status = os.waitpid(pid, 0)
            os.close(read)
            assert (os.WTERMSIG(status) == signal.SIGTERM) if how == "sigterm" else os.WEXITSTATUS(status) == 0
            assert sorted(os.listdir(shm_dir)) == [b.shm_name, b.shm_name + CLAIM], how
    finally:
        b.close()
    assert os.listdir(shm_dir) == []


CHAINED = textwrap.dedent("""
    import signal, sys
    def handler(signum, frame):
        print("previous handler ran", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, handler)
    from kvtier.tiers.cpu import backend as cpu
    cpu.SHM_DIR = sys.argv[1]
    backend = cpu.CPUBackend("cpu", 2, 4096, pin=False)
    print(backend.shm_name, flush=True)
    sys.stdin.readline()
""")


def test_sigterm_handler_chains_to_the_previous_one(shm_dir):
    proc = subprocess.Popen([sys.executable, "-c", CHAINED, str(shm_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    created = sorted(os.listdir(shm_dir))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    proc.stdin.close()
    assert created == [name, name + CLAIM], err
    assert proc.returncode == 7 and "previous handler ran" in out
    assert os.listdir(shm_dir) == []


def test_attach_with_another_regions_token_is_refused(shm_dir):
    """A worker told to map region A never maps B, even under A's name (here: A unpublished its name,
    its claim was removed behind its back, as by a kvtier without claims or a user's rm, and B took
    the name)."""
    a = cpu.CPUBackend("cpu", 4, 4096, shm_name="kvtier-x-cpu", pin=False)
    a.view(0)[:] = PATTERN
    a.unpublish()
    assert os.listdir(shm_dir) == ["kvtier-x-cpu" + CLAIM]
    os.unlink(shm_dir / ("kvtier-x-cpu" + CLAIM))
    other = Owner(shm_dir, "kvtier-x-cpu")  # another process takes the free name
    try:
        code = ("import sys; from kvtier.tiers.cpu import backend as cpu; cpu.SHM_DIR = sys.argv[1]\n"
                "try:\n"
                "    cpu.CPUBackend.attach('kvtier-x-cpu', 4, 4096, pin=False, token=sys.argv[2])\n"
                "except cpu.RegionError as exc:\n"
                "    print(exc); sys.exit(3)\n")
        refused = subprocess.run([sys.executable, "-c", code, str(shm_dir), a.token], capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode == 3, refused.stderr
        assert f"created by pid {other.proc.pid}" in refused.stdout and "token mismatch" in refused.stdout
        accepted = subprocess.run([sys.executable, "-c", code, str(shm_dir), other.token], capture_output=True,
                                  text=True, timeout=60)
        assert accepted.returncode == 0, accepted.stdout + accepted.stderr
        # in this process, A's token still maps A (through its creator's descriptor), not the name
        peer = cpu.CPUBackend.attach("kvtier-x-cpu", 4, 4096, pin=False, token=a.token)
        assert bytes(peer.view(0)) == PATTERN
        peer.close()
        a.close()
        # A's close removes neither B's region nor B's claim
        assert sorted(os.listdir(shm_dir)) == ["kvtier-x-cpu", "kvtier-x-cpu" + CLAIM]
        assert other.slot0_intact()
    finally:
        other.kill()


def test_unpublished_region_survives_sigkill_leaving_only_its_claim(shm_dir):
    """Once every process has mapped it and the name is gone, the region cannot leak: a SIGKILL
    leaves only the claim (a few bytes), which the next sweep removes."""
    owner = Owner(shm_dir, unpublish=True)
    assert os.listdir(shm_dir) == [owner.name + CLAIM]
    assert owner.kill() == -signal.SIGKILL
    assert os.listdir(shm_dir) == [owner.name + CLAIM]
    assert os.path.getsize(shm_dir / (owner.name + CLAIM)) < 64
    assert cpu.remove_stale_regions(str(shm_dir), min_age_s=0) == [owner.name + CLAIM]
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("bad", ["a\x00b", "é" * 200, "k" * 243, ".hidden", "-x", "a b", "kvtier-creating-1-2",
                                 "x.kvtier-claim"])
def test_bad_shm_name_is_a_config_error_naming_the_field(bad):
    import yaml

    text = yaml.safe_dump({"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "1MiB", "shm_name": bad}]},
                          allow_unicode=True)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.shm_name") as info:
        load_config_text(text)
    assert "A-Z a-z 0-9" in str(info.value) and len(str(info.value)) < 400
    assert time.monotonic() - start < 5


def test_longest_allowed_shm_name_works(shm_dir):
    b = cpu.CPUBackend("cpu", 1, 4096, shm_name="k" * 242, pin=False)  # its claim's name: 255 bytes
    assert sorted(os.listdir(shm_dir)) == ["k" * 242, "k" * 242 + CLAIM]
    b.close()
    assert os.listdir(shm_dir) == []


# ------------------------------------------------------------------------------ vLLM spec
vllm_only = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
PAGE = 4096


def _spec(tmp_path, engine_id):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier.integrations.vllm import KVTierOffloadingSpec

    tiers = [{"name": "cpu", "backend": "cpu", "capacity": "4 blocks", "pin": False}]
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=False,
        extra_config={"kvtier_config": {"tiers": tiers}}, engine_id=engine_id,
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))
    return KVTierOffloadingSpec(config)


def _caches():
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    engine = torch.randint(-128, 127, (4, PAGE), dtype=torch.int8)
    return engine, CanonicalKVCaches([CanonicalKVCacheTensor(engine, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])


def _key(i):
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(32, "big"), 0)


@vllm_only
@pytest.mark.parametrize("worker", ["in-process", "none-yet"])
def test_second_engine_with_the_same_engine_id_is_refused_and_the_first_keeps_its_region(tmp_path, worker):
    """Also after the first engine's in-process worker (vLLM's default executor for one worker)
    made it remove its region's name: its claim still holds the name."""
    from vllm.v1.kv_offload.base import ReqContext

    engine_id = f"twin-{os.getpid()}-{time.time_ns()}"
    first, second = _spec(tmp_path, engine_id), _spec(tmp_path, engine_id)
    first_worker = first.get_worker(_caches()[1]) if worker == "in-process" else None
    m = first.get_manager()
    try:
        region = m.manager.tiers[0].backend
        assert os.path.exists(region.path) == (worker == "none-yet")
        out = m.prepare_store([_key(1)], ReqContext("r"))
        region.view(out.store_spec.block_ids[0])[:] = PATTERN
        published = os.stat(region.path) if worker == "none-yet" else None
        with pytest.raises(cpu.RegionInUseError, match=f"region {region.shm_name} is in use by pid {os.getpid()}"):
            second.get_manager()
        if published is not None:  # the very region the first engine published, not a new one
            assert os.path.exists(region.path) and os.stat(region.path).st_ino == published.st_ino
        assert os.path.exists(region.path + CLAIM)
        assert bytes(region.view(out.store_spec.block_ids[0])) == PATTERN
        assert not [n for n in os.listdir(cpu.SHM_DIR) if n.startswith(f"kvtier-creating-{os.getpid()}-")]
    finally:
        if first_worker is not None:
            first_worker.shutdown()
        m.shutdown()
    assert not os.path.exists(region.path) and not os.path.exists(region.path + CLAIM)


@vllm_only
def test_worker_maps_only_its_schedulers_region_then_drops_the_name(tmp_path):
    """The token travels with the CPU specs; after the worker mapped the region, its name is gone
    from /dev/shm (a kill can no longer leak it), and transfers keep working."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext

    from kvtier.integrations.vllm import KVTierCPULoadStoreSpec

    spec = _spec(tmp_path, f"w-{os.getpid()}-{time.time_ns()}")
    engine, caches = _caches()
    m = spec.get_manager()
    worker = spec.get_worker(caches)
    try:
        path = m.manager.tiers[0].backend.path
        assert os.path.exists(path)  # the worker has not mapped it yet: the name is still needed
        out = m.prepare_store([_key(1)], ReqContext("r"))
        assert out.store_spec.region == m.manager.tiers[0].backend.token
        forged = KVTierCPULoadStoreSpec(out.store_spec.block_ids, "cpu", "00" * 16)
        with pytest.raises(cpu.RegionError, match="token mismatch"):
            worker.submit_store(1, GPULoadStoreSpec([2], group_sizes=[1], block_indices=[0]), forged)
        assert worker.submit_store(2, GPULoadStoreSpec([2], group_sizes=[1], block_indices=[0]), out.store_spec)
        worker.wait({2})
        assert [r.success for r in worker.get_finished()] == [True]
        assert not os.path.exists(path)
        with pytest.raises(cpu.RegionError, match="token"):
            worker.submit_load(3, forged, GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0]))
        assert worker.submit_load(4, out.store_spec, GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0]))
        worker.wait({4})
        assert [r.success for r in worker.get_finished()] == [True]
        assert bytes(engine[0].numpy()) == bytes(engine[2].numpy())
    finally:
        worker.shutdown()
        m.shutdown()


@vllm_only
def test_in_process_worker_makes_the_scheduler_drop_the_name_at_once(tmp_path):
    """vLLM's default executor for one worker runs it in the scheduler's process, where get_worker
    comes first: the region's name is removed as soon as it is created, and the worker maps it."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext

    engine_id = f"uni-{os.getpid()}-{time.time_ns()}"
    worker_side, scheduler_side = _spec(tmp_path, engine_id), _spec(tmp_path, engine_id)
    engine, caches = _caches()
    worker = worker_side.get_worker(caches)
    m = scheduler_side.get_manager()
    try:
        assert not os.path.exists(m.manager.tiers[0].backend.path)
        out = m.prepare_store([_key(1)], ReqContext("r"))
        assert worker.submit_store(1, GPULoadStoreSpec([3], group_sizes=[1], block_indices=[0]), out.store_spec)
        worker.wait({1})
        assert [r.success for r in worker.get_finished()] == [True]
        assert bytes(m.manager.tiers[0].backend.view(out.store_spec.block_ids[0])) == bytes(engine[3].numpy())
    finally:
        worker.shutdown()
        m.shutdown()


def test_config_check_env_names_a_shm_name_in_use_before_the_build_refuses_it(shm_dir, tmp_path, capsys):
    """Before: `kvtier config check --env` passed (exit 0) a cpu tier whose shm_name a live process
    held; the build then raised RegionInUseError."""
    from kvtier.cli.main import main

    path = tmp_path / "held.yaml"
    path.write_text("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: cpu, capacity: 4 blocks, pin: false, "
                    "shm_name: kvtier-engine-a-cpu}\n")
    owner = Owner(shm_dir, "kvtier-engine-a-cpu")
    try:
        assert main(["config", "check", "--env", str(path)]) == 2
        assert "tiers[0].shm_name: region kvtier-engine-a-cpu is in use" in capsys.readouterr().err
        assert owner.slot0_intact()  # (asked, not touched)
    finally:
        owner.kill()
    assert main(["config", "check", "--env", str(path)]) == 0  # its owner gone: the name is free again


def test_config_check_env_refuses_pin_true_without_cuda(tmp_path, capsys):
    """Before: passed (exit 0); the build raised RuntimeError("pin=true but CUDA is not available")."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: pin: true is fine")
    from kvtier.cli.main import main

    path = tmp_path / "pin.yaml"
    path.write_text("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: cpu, capacity: 4 blocks, pin: true}\n")
    assert main(["config", "check", "--env", str(path)]) == 2
    assert "tiers[0].pin: true, but CUDA is not available here" in capsys.readouterr().err


def test_config_check_env_names_the_owner_of_a_name_held_by_its_claim_alone(shm_dir, tmp_path, capsys):
    """A live owner that removed its region's name still holds the name by its claim: the check
    names the owner's pid, as the build's refusal does (the check and the build share one test)."""
    from kvtier.cli.main import main

    path = tmp_path / "held.yaml"
    path.write_text("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: cpu, capacity: 4 blocks, pin: false, "
                    "shm_name: kvtier-engine-a-cpu}\n")
    owner = Owner(shm_dir, "kvtier-engine-a-cpu", unpublish=True)
    try:
        assert not os.path.exists(shm_dir / "kvtier-engine-a-cpu")
        assert main(["config", "check", "--env", str(path)]) == 2
        assert f"region kvtier-engine-a-cpu is in use by pid {owner.proc.pid}" in capsys.readouterr().err
    finally:
        owner.kill()
    assert main(["config", "check", "--env", str(path)]) == 0
