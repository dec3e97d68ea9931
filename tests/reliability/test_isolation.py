"""Isolation: only the owning user can read a tier's bytes, and one root_dir has one owner process.

The other-user checks run a real process as `nobody` (uid 65534) and need root to start it; they
are skipped otherwise. The root_dir lives under a world-traversable directory so that only the
tier's own modes stand between that user and the bytes.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest
from reliability_helpers import build, fill_file_tier, payload, read, shm_files

from kvtier import KVTierError

NOBODY = 65534
TIER_FILES = ("lock", "manifest.json", "slab.0", "journal")


@pytest.fixture
def open_dir():
    """A world-traversable (0755) scratch directory."""
    d = tempfile.mkdtemp(prefix="kvtier-iso-")
    os.chmod(d, 0o755)
    yield d
    subprocess.run(["rm", "-rf", d])


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_file_tier_modes(open_dir):
    root = os.path.join(open_dir, "kv")
    h = build(root, upper="cpu")
    try:
        fill_file_tier(h, 3)
        assert mode(root) == 0o700
        for name in TIER_FILES:
            assert mode(os.path.join(root, name)) == 0o600, name
        shm = h.backends["up"].path
        assert mode(shm) == 0o600
        assert os.stat(shm).st_uid == os.getuid()
    finally:
        h.close()


def test_existing_root_dir_keeps_its_mode_but_files_are_private(open_dir):
    """A root_dir made beforehand (here 0755) is not re-moded; every file in it is still 0600."""
    root = os.path.join(open_dir, "premade")
    os.mkdir(root, 0o755)
    os.chmod(root, 0o755)
    h = build(root)
    try:
        fill_file_tier(h, 2)
        assert mode(root) == 0o755
        for name in TIER_FILES:
            assert mode(os.path.join(root, name)) == 0o600, name
    finally:
        h.close()


def _as_nobody(paths: list[str]) -> dict[str, str]:
    """Try to read each path as uid/gid 65534 (with /bin/head: the project's interpreter may not be
    executable by that user); returns path -> "read" or "denied"."""
    for p in paths:
        assert os.path.exists(p), p
    script = 'for p in "$@"; do if head -c 16 "$p" >/dev/null 2>&1; then echo read; else echo denied; fi; done'
    proc = subprocess.run(["/bin/sh", "-c", script, "sh", *paths], capture_output=True, text=True, timeout=60,
                          user=NOBODY, group=NOBODY, extra_groups=[], cwd="/")
    assert proc.returncode == 0, proc.stderr
    return dict(zip(paths, proc.stdout.split()))


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another user needs root")
@pytest.mark.parametrize("premade", [False, True])
def test_another_user_cannot_read_the_bytes(open_dir, premade):
    root = os.path.join(open_dir, "kv")
    if premade:
        os.mkdir(root)
        os.chmod(root, 0o755)
    h = build(root, upper="cpu")
    try:
        fill_file_tier(h, 3)
        shm = h.backends["up"].path
        paths = [os.path.join(root, n) for n in TIER_FILES] + [shm]
        outcome = _as_nobody(paths)
        assert set(outcome.values()) == {"denied"}, outcome
        # sanity: the same process can read a world-readable file (the check is not vacuous)
        probe = os.path.join(open_dir, "public")
        with open(probe, "w") as f:
            f.write("x")
        os.chmod(probe, 0o644)
        assert _as_nobody([probe]) == {probe: "read"}
    finally:
        h.close()


OWNER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from reliability_helpers import build, fill_file_tier
    h = build(sys.argv[1], upper="cpu")
    fill_file_tier(h, 4)
    print("READY", flush=True)
    sys.stdin.readline()
    h.close()
    print("CLOSED", flush=True)
""")


def _start_owner(root):
    proc = subprocess.Popen([sys.executable, "-c", OWNER, root, os.path.dirname(__file__)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "READY":
        proc.kill()
        raise AssertionError(f"owner did not start: {line} {proc.stderr.read()}")
    return proc


def test_second_process_gets_a_clear_lock_error(tmp_path):
    root = str(tmp_path / "kv")
    owner = _start_owner(root)
    try:
        before = shm_files()
        with pytest.raises(KVTierError, match=rf"in use by another process of yours \(pid {owner.pid}\).*own root_dir"):
            build(root, upper="cpu")
        assert shm_files() == before, "the failed build leaked its CPU tier"
        # a second *process* gets the same error, through the public API
        code = ("import sys; sys.path.insert(0, sys.argv[2]); from reliability_helpers import build\n"
                "try:\n    build(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)")
        out = subprocess.run([sys.executable, "-c", code, root, os.path.dirname(__file__)],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith("KVTierError") and f"pid {owner.pid}" in out.stdout, out.stdout + out.stderr
        # inspect reads it meanwhile (no lock) and names the live owner
        insp = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", root],
                              capture_output=True, text=True, timeout=60)
        assert insp.returncode == 0 and f"open by process {owner.pid}" in insp.stdout, insp.stdout
        owner.stdin.write("\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "CLOSED"
    finally:
        owner.kill()
        owner.wait()
        for f in (owner.stdin, owner.stdout, owner.stderr):
            f.close()
    # the owner's blocks are intact for the next process
    h = build(root)
    try:
        recovered = [bytes(k) for k in h.manager.tiers[1].policy.keys()]
        assert recovered
        assert all(read(h, k) == payload(k) for k in recovered)
    finally:
        h.close()


def test_lock_of_a_killed_owner_is_released(tmp_path):
    root = str(tmp_path / "kv")
    owner = _start_owner(root)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    for f in (owner.stdin, owner.stdout, owner.stderr):
        f.close()
    for name in [n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-{owner.pid}-")]:
        os.unlink(os.path.join("/dev/shm", name))  # a SIGKILLed owner leaves its region (docs/reliability.md)
    insp = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", root],
                          capture_output=True, text=True, timeout=60)
    assert f"stale lock of process {owner.pid}" in insp.stdout, insp.stdout
    h = build(root)
    try:
        recovered = [bytes(k) for k in h.manager.tiers[1].policy.keys()]
        assert recovered and all(read(h, k) == payload(k) for k in recovered)
    finally:
        h.close()


SHM_OWNER = textwrap.dedent("""
    import sys
    from kvtier.tiers.cpu import backend as cpu
    cpu.SHM_DIR = sys.argv[1]  # a private directory: the sweep below must not touch other users' /dev/shm
    backend = cpu.CPUBackend("cpu", 4, 4096, pin=False)
    print(backend.shm_name, flush=True)
    sys.stdin.readline()
""")


def _shm_owner(shm_dir):
    proc = subprocess.Popen([sys.executable, "-c", SHM_OWNER, shm_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name.startswith(f"kvtier-{proc.pid}-"), name + proc.stderr.read() if not name else name
    return proc, name


def test_region_of_a_killed_owner_is_swept_the_live_one_kept(tmp_path):
    """A SIGKILLed owner cannot unlink its shared-memory region; the next CPU tier created removes
    regions whose owner is gone (no flock held, pid gone) and keeps those of live owners."""
    from kvtier.tiers.cpu import backend as cpu

    shm_dir = str(tmp_path / "shm")
    os.mkdir(shm_dir)
    live, live_name = _shm_owner(shm_dir)
    dead, dead_name = _shm_owner(shm_dir)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        claim = cpu.CLAIM_SUFFIX  # each region's name is held by its claim (a few bytes) for its owner's life
        assert sorted(os.listdir(shm_dir)) == sorted([live_name, live_name + claim, dead_name, dead_name + claim])
        assert sorted(cpu.remove_stale_regions(shm_dir, min_age_s=0)) == [dead_name, dead_name + claim]
        assert sorted(os.listdir(shm_dir)) == [live_name, live_name + claim]
        assert cpu.remove_stale_regions(shm_dir, min_age_s=0) == []
    finally:
        for p in (live, dead):
            p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()
    # the live owner is gone now too (killed): its region goes at the next sweep
    assert sorted(cpu.remove_stale_regions(shm_dir, min_age_s=0)) == [live_name, live_name + cpu.CLAIM_SUFFIX]


def test_fresh_regions_are_not_swept(tmp_path):
    """A region younger than min_age_s is never removed (its creator may not have locked it yet)."""
    from kvtier.tiers.cpu import backend as cpu

    shm_dir = str(tmp_path / "shm")
    os.mkdir(shm_dir)
    path = os.path.join(shm_dir, "kvtier-999999999-abcd-cpu")  # no such pid, no lock
    open(path, "wb").close()
    assert cpu.remove_stale_regions(shm_dir, min_age_s=3600) == []
    assert os.path.exists(path)
