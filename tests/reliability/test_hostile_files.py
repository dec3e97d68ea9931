"""Hostile or stale files in a file tier's root_dir: never served, and reported by `kvtier inspect`.

Each test writes blocks through a hierarchy, closes it, damages or replaces files the way a disk
fault, an operator or another deployment could, restarts on the same root_dir and reads every
block back through the manager (lookup -> RETRY -> promotion -> HIT, or MISS). A damaged block is
a MISS, never bytes that are not its own. `kvtier inspect ROOT [--verify]` runs as a subprocess.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib

import pytest
from conftest import flip
from reliability_helpers import BLOCK, assert_settled, build, fill_file_tier, keys, payload, read, store

from kvtier import ConfigError, LookupResult
from kvtier.tiers.file.backend import (
    HEADER_BYTES,
    JOURNAL,
    MANIFEST,
    MAX_KEY_BYTES,
    SLAB,
    manifest_digest,
    pack_header,
    scan_journal,
    slot_bytes_for,
)
from kvtier.tiers.file.inspection import inspect_root

SLOT = slot_bytes_for(BLOCK)
CHILD_MEMORY = 1 << 30  # address-space limit of the subprocesses below: a runaway read fails fast, harmlessly
HERE = os.path.dirname(os.path.abspath(__file__))


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def _child_env() -> dict:
    path = [HERE, os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def run_inspect(root, verify=True, tmp=None):
    """`kvtier inspect ROOT --json FILE [--verify]` in a memory-limited subprocess: (report, stdout)."""
    args = [sys.executable, "-m", "kvtier.cli.main", "inspect", str(root)]
    out_json = os.path.join(tmp or str(root) + ".inspect", "report.json")
    os.makedirs(os.path.dirname(out_json), exist_ok=True)
    args += ["--json", out_json] + (["--verify"] if verify else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, preexec_fn=_limit_memory)
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(open(out_json).read())
    failed = verify and bool(report.get("verify_failed") or report.get("verify_error"))
    assert proc.returncode == (1 if failed else 0), proc.stderr  # --verify: non-zero when a block failed
    return report, proc.stdout


def inspect(root, verify=True, tmp=None) -> dict:
    return run_inspect(root, verify, tmp)[0]


_START = """
import json, logging, sys
from kvtier.core.errors import KVTierError
from reliability_helpers import build
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
try:
    h = build(sys.argv[1])
except KVTierError as exc:
    print(json.dumps({"refused": str(exc)}))
else:
    print(json.dumps({"recovered": len(h.manager.tiers[1].policy)}))
    h.close()
"""


def start_in_child(root):
    """Start a hierarchy on `root` in a memory-limited subprocess (60 s at most): (outcome, log).
    outcome is {"recovered": n} or {"refused": message of the KVTierError}."""
    proc = subprocess.run([sys.executable, "-c", _START, str(root)], capture_output=True, text=True, timeout=60,
                          env=_child_env(), preexec_fn=_limit_memory)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@contextlib.contextmanager
def deadline(seconds):
    """Fail (instead of hanging the suite) if the body takes longer than `seconds`."""
    def expired(_sig, _frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def append_record(root, op, slot, key=b"", crc=0):
    """Append a well-formed journal record (valid CRC) after the last one, as a writer would."""
    body = struct.pack("<BxHQI", op, len(key), slot, crc) + key
    record = struct.pack("<I", zlib.crc32(body)) + body
    data = bytearray((root / JOURNAL).read_bytes())
    end = scan_journal(bytes(data)).good_bytes  # where the next record would go
    data[end:end + len(record)] = record
    (root / JOURNAL).write_bytes(bytes(data))


def num_slots(root) -> int:
    return json.loads((root / MANIFEST).read_text())["num_slots"]


@pytest.fixture
def written(tmp_path):
    """A root_dir holding committed blocks; returns (root, {slot: key} on disk, all keys)."""
    root = tmp_path / "kv"
    h = build(root)
    ks = fill_file_tier(h, 10)
    committed = h.backends["disk"].committed()
    h.close()
    on_disk = {slot: key for slot, key in committed.items() if key in set(map(bytes, ks))}
    assert len(on_disk) >= 8
    return root, on_disk, ks


def serve_all(root, **kw):
    """Restart on `root`; read every recovered file-tier block alone (one promotion each)."""
    h = build(root, **kw)
    try:
        recovered = [bytes(k) for k in h.manager.tiers[1].policy.keys()]
        served = {}
        for k in recovered:
            data = read(h, k)
            assert data is None or data == payload(k), "a block was served with bytes that are not its own"
            served[k] = data is not None
        assert_settled(h.manager)
        return served
    finally:
        h.close()


def test_untouched_root_serves_everything(written):
    root, on_disk, _ = written
    served = serve_all(root)
    assert all(served[k] for k in on_disk.values())
    report = inspect(root)
    assert report["index_health"] == "ok" and report["verify_failed"] == 0


@pytest.mark.parametrize("where,reason", [
    ("payload", "payload checksum mismatch"),
    ("payload_last", "payload checksum mismatch"),
    ("magic", "bad magic"),
    ("header_crc", "header checksum mismatch"),
    ("key", "header checksum mismatch"),
    ("check_kind", "header checksum mismatch"),
])
def test_bit_flip_is_never_served(written, where, reason):
    root, on_disk, _ = written
    slot = sorted(on_disk)[2]
    offset = {"payload": HEADER_BYTES + 100, "payload_last": HEADER_BYTES + BLOCK - 1, "magic": 0,
              "header_crc": 4 + 2 + 2 + 2 + 2 + 8 + 4 + 8, "key": 40, "check_kind": 8}[where]  # format v2 offsets
    flip(root / SLAB, slot * SLOT + offset)
    report = inspect(root)
    assert report["verify_failed"] == 1
    assert report["failures"][0]["slot"] == slot and reason in report["failures"][0]["reason"]
    served = serve_all(root)
    assert served[on_disk[slot]] is False
    assert all(served[k] for s, k in on_disk.items() if s != slot)


def test_one_bad_block_in_a_promotion_batch_does_not_drop_the_good_ones(written):
    root, on_disk, _ = written
    bad_slot = sorted(on_disk)[0]
    flip(root / SLAB, bad_slot * SLOT + HEADER_BYTES + 7)
    h = build(root)
    try:
        mgr = h.manager
        batch = [on_disk[s] for s in sorted(on_disk)[:4]]  # one promotion job of 4 blocks
        assert all(mgr.lookup(k) is LookupResult.RETRY for k in batch)
        mgr.on_schedule_end()
        mgr.wait_idle()
        assert mgr.lookup(on_disk[bad_slot]) is LookupResult.MISS
        assert mgr.tiers[1].policy.get(on_disk[bad_slot]) is None
        for k in batch[1:]:
            assert mgr.tiers[1].policy.get(k) is not None, "a good block was dropped with the bad one"
            data = read(h, k)  # this job's failure may answer MISS once; then it is promoted again
            assert (data if data is not None else read(h, k)) == payload(k)
    finally:
        h.close()


def test_truncated_slab(written):
    root, on_disk, _ = written
    keep = sorted(on_disk)[len(on_disk) // 2]
    os.truncate(root / SLAB, keep * SLOT + SLOT // 2)  # cuts through the slot `keep`
    report = inspect(root)
    assert "slab truncated" in report["index_health"]
    assert report["verify_failed"] >= 1 and all(f["reason"] == "slab truncated" for f in report["failures"])
    served = serve_all(root)
    for slot, key in on_disk.items():
        if slot < keep:
            assert served[key]
        else:
            assert not served.get(key, False)


def test_manifest_of_another_model_starts_empty(written, caplog):
    root, on_disk, _ = written
    report = inspect(root, verify=False)
    assert report["fingerprint"] == "model-a/layout-1"
    with pytest.raises(ConfigError, match="holds the blocks of another model"):  # by default: kept, refused
        build(root, fingerprint="model-b/layout-1")
    served = serve_all(root, fingerprint="model-b/layout-1", reset=True)
    assert served == {}
    report = inspect(root)
    assert report["fingerprint"] == "model-b/layout-1" and report["blocks"] == 0
    # and model A does not get its blocks back either: they were erased on purpose
    assert serve_all(root, reset=True) == {}


def test_manifest_of_another_block_geometry_starts_empty(written):
    root, _, _ = written
    with pytest.raises(ConfigError, match="layout: found"):  # the layout names the block geometry
        build(root, block_bytes=2 * BLOCK)
    h = build(root, block_bytes=2 * BLOCK, reset=True)
    try:
        assert len(h.manager.tiers[1].policy) == 0
    finally:
        h.close()


def test_manifest_and_slab_from_another_root_are_not_served(written, tmp_path):
    """Same model, same geometry, but the slab (or the manifest) comes from another deployment:
    the epoch stamped into every slot header differs, so no block verifies."""
    root, on_disk, _ = written
    other = tmp_path / "other"
    h = build(other)
    fill_file_tier(h, 10, 500)
    h.close()
    shutil.copy(other / SLAB, root / SLAB)
    report = inspect(root)
    assert report["verify_failed"] == report["blocks"] > 0
    assert all("another manifest" in f["reason"] or "another key" in f["reason"] for f in report["failures"])
    served = serve_all(root)
    assert not any(served.values())
    # the other's manifest with our journal: another epoch -> the tier starts empty
    shutil.copy(other / MANIFEST, root / MANIFEST)
    assert "epoch" in inspect(root, verify=False)["index_health"]
    assert serve_all(root) == {}


def test_garbage_manifest(written):
    root, _, _ = written
    (root / MANIFEST).write_bytes(os.urandom(300))
    assert "no readable manifest" in inspect(root)["index_health"]
    assert serve_all(root) == {}


def test_garbage_journal(written):
    root, _, _ = written
    size = (root / JOURNAL).stat().st_size
    (root / JOURNAL).write_bytes(os.urandom(size))
    report = inspect(root)
    assert "journal header not recognised" in report["index_health"] and report["blocks"] == 0
    assert serve_all(root) == {}


def test_garbage_journal_tail_is_ignored(written):
    root, on_disk, _ = written
    report = inspect(root, verify=False)
    data = bytearray((root / JOURNAL).read_bytes())
    end = scan_journal(bytes(data)).good_bytes  # where the next record would go
    data[end:end + 64] = os.urandom(64)
    (root / JOURNAL).write_bytes(bytes(data))
    report = inspect(root, verify=False)
    assert "torn journal tail" in report["index_health"]
    served = serve_all(root)
    assert all(served[k] for k in on_disk.values())


def test_forged_journal_record_is_not_served(written):
    """A well-formed journal record (valid CRC) claiming that a slot holds another key."""
    root, on_disk, ks = written
    slot = sorted(on_disk)[1]
    forged_key = bytes(ks[-1])[:-1] + b"\x7f"
    append_record(root, 1, slot, forged_key)
    report = inspect(root)
    assert any(f["slot"] == slot for f in report["failures"])
    served = serve_all(root)
    assert served.get(forged_key) is False
    assert all(served[k] for s, k in on_disk.items() if s != slot)


def test_foreign_files_in_root_dir_are_left_alone(written):
    root, on_disk, _ = written
    (root / "README.txt").write_text("not ours")
    (root / "slab.1").write_bytes(os.urandom(SLOT * 2))
    os.mkdir(root / "subdir")
    served = serve_all(root)
    assert all(served[k] for k in on_disk.values())
    assert (root / "README.txt").read_text() == "not ours"
    assert inspect(root)["verify_failed"] == 0


def test_inspect_of_a_root_that_is_not_a_tier(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_bytes(os.urandom(100))
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", str(tmp_path / "junk")],
                          capture_output=True, text=True, timeout=60, preexec_fn=_limit_memory)
    assert proc.returncode == 2 and "is not a file tier's root_dir" in proc.stderr, proc.stderr  # issue 26.17
    report = inspect_root(str(tmp_path / "junk"))
    assert "no readable manifest" in report["index_health"] and report["blocks"] == 0 and not report["is_tier"]


@pytest.mark.parametrize("patch", [
    {"slot_bytes": 0}, {"slot_bytes": "x"}, {"slot_bytes": 100}, {"block_bytes": -5}, {"block_bytes": 10 ** 12},
    {"num_slots": "many"}, {"num_slots": -1}, {"epoch": 5}, {"format_version": 99}, None,
], ids=lambda p: "list" if p is None else "-".join(f"{k}={v}" for k, v in p.items())[:40])
def test_hostile_manifest_values(written, patch):
    """A manifest that parses as JSON but carries nonsense: the tier starts empty, and inspect
    reports it (with and without --verify) instead of failing."""
    root, _, _ = written
    manifest = json.loads((root / MANIFEST).read_text())
    manifest = [1, 2] if patch is None else {**manifest, **patch}
    (root / MANIFEST).write_text(json.dumps(manifest))
    for verify in (False, True):
        report = inspect(root, verify=verify)
        assert report["index_health"] != "ok" or patch in ({"epoch": 5},)
        if verify:
            assert report["verified_ok"] == 0
    assert serve_all(root) == {}


# ---------------------------------------------------------------------------- hostile records and files
def _beyond_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "beyond the slab" in r.getMessage()]


@pytest.mark.parametrize("past", [0, 5, "2**40"])
def test_journal_put_beyond_the_slab_is_ignored(written, caplog, past):
    """A checksum-valid PUT naming slot num_slots + `past` (or 2^40): ignored with one warning,
    reported by inspect for what it is, never handed to the allocator; demotions keep working."""
    root, on_disk, _ = written
    slots = num_slots(root)
    bad_slot = 2 ** 40 if past == "2**40" else slots + past
    forged = bytes(keys(1, 777)[0])
    append_record(root, 1, bad_slot, forged)

    report, stdout = run_inspect(root)
    assert "1 journal records name slots beyond the slab (ignored)" in report["index_health"]
    assert "slab truncated" not in report["index_health"]
    assert report["blocks"] == len(on_disk) and report["verify_failed"] == 0
    assert "beyond the slab" in stdout

    caplog.set_level(logging.WARNING, logger="kvtier")
    tracemalloc.start()
    started = time.monotonic()
    try:
        h = build(root)
        took = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    try:
        assert took < 10 and peak < 64 << 20, (took, peak)  # generous: ~0.05 s and a few MiB here
        assert len(_beyond_warnings(caplog)) == 1 and "1 journal records" in _beyond_warnings(caplog)[0]
        mgr, disk = h.manager, h.backends["disk"]
        assert mgr.tiers[1].policy.get(forged) is None
        assert set(disk.committed()) == set(on_disk) and max(disk.committed()) < slots
        assert disk.get_num_free_blocks() == slots - len(on_disk)
        # every slot the allocator can hand out is in range: fill the file tier twice over
        fresh = keys(2 * slots, 5000)
        for k in fresh:
            store(h, [k])
        assert_settled(mgr)
        assert all(t.stats.failures == 0 for t in mgr.tiers), [t.stats for t in mgr.tiers]
        assert len(mgr.tiers[1].policy) == slots
        assert max(disk.committed()) < slots
        for k in fresh[-4:]:
            assert read(h, k) == payload(k)
    finally:
        h.close()
    caplog.clear()
    h = build(root)  # the journal was rewritten without the record: no second warning
    h.close()
    assert _beyond_warnings(caplog) == []
    assert "beyond the slab" not in inspect(root, verify=False)["index_health"]


def test_journal_put_of_an_impossible_key_is_ignored(written, caplog):
    """A PUT whose key is longer than a slot header can hold was never written by a backend."""
    root, on_disk, _ = written
    free_slot = next(s for s in range(num_slots(root)) if s not in on_disk)
    long_key = os.urandom(MAX_KEY_BYTES + 1)
    append_record(root, 1, free_slot, long_key)
    assert "keys longer than" in inspect(root, verify=False)["index_health"]
    caplog.set_level(logging.WARNING, logger="kvtier")
    served = serve_all(root)
    assert long_key not in served and all(served[k] for k in on_disk.values())
    assert any("keys longer than" in r.getMessage() for r in caplog.records)


def test_one_key_journalled_in_two_slots_is_never_served_from_the_wrong_one(written):
    """A forged PUT moves key A into the slot that holds key B: A's later record wins, the slot's
    header names B, so A is a MISS (never B's bytes) and everything else is served."""
    root, on_disk, _ = written
    slot_a, slot_b = sorted(on_disk)[1], sorted(on_disk)[3]
    key_a, key_b = on_disk[slot_a], on_disk[slot_b]
    append_record(root, 1, slot_b, key_a)
    report = inspect(root)
    assert "more than one slot" in report["index_health"]
    assert any(f["slot"] == slot_b and "another key" in f["reason"] for f in report["failures"])
    served = serve_all(root)  # asserts that no block is served with bytes that are not its own
    assert served.get(key_a) is False and key_b not in served
    assert all(served[k] for s, k in on_disk.items() if s not in (slot_a, slot_b))


@pytest.mark.parametrize("payload_len", [2 ** 64 - 1, 2 ** 63, 0, BLOCK + 1])
def test_slot_header_with_an_impossible_payload_length(written, payload_len):
    """A slot header that checksums correctly but claims an impossible payload length."""
    root, on_disk, _ = written
    slot = sorted(on_disk)[2]
    digest = manifest_digest(json.loads((root / MANIFEST).read_text()))
    header = bytearray(HEADER_BYTES)
    pack_header(memoryview(header), on_disk[slot], payload_len, 0, digest)
    with open(root / SLAB, "r+b") as f:
        f.seek(slot * SLOT)
        f.write(header)
    report = inspect(root)
    assert [f["reason"] for f in report["failures"]] == [f"payload length {payload_len}, expected {BLOCK}"]
    served = serve_all(root)
    assert served[on_disk[slot]] is False
    assert all(served[k] for s, k in on_disk.items() if s != slot)


@pytest.mark.parametrize("name", [JOURNAL, MANIFEST])
def test_metadata_symlinked_to_dev_zero(written, name):
    """`journal` or `manifest.json` -> /dev/zero: never read (no MemoryError), reported as not a
    regular file; the tier starts empty (or refuses, naming the file) within seconds."""
    root, _, _ = written
    os.unlink(root / name)
    os.symlink("/dev/zero", root / name)
    started = time.monotonic()
    report = inspect(root)
    assert "not a regular file (a symbolic link)" in report["index_health"]
    outcome, log = start_in_child(root)
    assert time.monotonic() - started < 60
    if "refused" in outcome:
        assert name in outcome["refused"]
    else:
        assert outcome == {"recovered": 0}
        assert "not a regular file" in log and "starting empty" in log
        assert not os.path.islink(root / name), "the symlink should have been replaced by a file of our own"
        assert serve_all(root) == {}
    assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)


@pytest.mark.parametrize("content", ["nested", "oversized"])
def test_manifest_that_is_too_deep_or_too_big(written, content):
    """JSON nested past the parser's depth (RecursionError, not ValueError) or a manifest of
    megabytes: the tier starts empty, inspect says why."""
    root, _, _ = written
    data = b"[" * 200_000 if content == "nested" else b'{"x": "' + b" " * (2 << 20) + b'"}'
    (root / MANIFEST).write_bytes(data)
    health = inspect(root)["index_health"]
    assert "no readable manifest" in health
    assert ("not JSON" if content == "nested" else "larger than") in health
    assert serve_all(root) == {}


def test_oversized_journal_is_not_read_whole(written):
    """A sparse journal of 4 GiB is larger than any journal of this geometry: refused by its size
    (start empty with a warning), never read into memory."""
    root, _, _ = written
    os.truncate(root / JOURNAL, 4 << 30)
    assert "larger than" in inspect(root, verify=False)["index_health"]
    outcome, log = start_in_child(root)
    assert outcome == {"recovered": 0} and "larger than" in log
    assert (root / JOURNAL).stat().st_size < 64 << 20
    assert serve_all(root) == {}


def _fifo(path):
    os.mkfifo(path)


def _symlink_to_dev_zero(path):
    os.symlink("/dev/zero", path)


def _char_device(path):
    if os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers


@pytest.mark.parametrize("make,kind", [(_fifo, "a FIFO"), (_symlink_to_dev_zero, "a symbolic link"),
                                       (_char_device, "a character device")], ids=["fifo", "symlink", "device"])
def test_slab_that_is_not_a_regular_file(written, make, kind):
    """`inspect --verify` never opens a FIFO or device as the slab (a FIFO would block it forever),
    and the tier refuses to start on it (naming the file) instead of failing with EINVAL."""
    root, on_disk, _ = written
    os.unlink(root / SLAB)
    make(root / SLAB)
    with deadline(20):
        report = inspect_root(str(root), verify=True)
    assert f"slab.0: not a regular file ({kind})" in report["index_health"]
    assert report["verify_error"] == f"slab.0: not a regular file ({kind})"
    assert report["verified_ok"] == 0 and report["verify_failed"] == len(on_disk)
    report, stdout = run_inspect(root)
    assert report["verify_error"] == f"slab.0: not a regular file ({kind})" and "not a regular file" in stdout
    outcome, _log = start_in_child(root)
    refused = outcome.get("refused", "")
    # A symlink is already refused by the root_dir checks (tests/reliability/test_root_dir_safety.py).
    assert SLAB in refused and ("not a regular file" in refused or "is a symlink" in refused), outcome
    assert not stat.S_ISREG(os.lstat(root / SLAB).st_mode), "the foreign slab path was replaced"
