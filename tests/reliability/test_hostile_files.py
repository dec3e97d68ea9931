"""Hostile or stale files in a file tier's root_dir: never served, and reported by `kvtier inspect`.

Each test writes blocks through a hierarchy, closes it, damages or replaces files the way a disk
fault, an operator or another deployment could, restarts on the same root_dir and reads every
block back through the manager (lookup -> RETRY -> promotion -> HIT, or MISS). A damaged block is
a MISS, never bytes that are not its own. `kvtier inspect ROOT [--verify]` runs as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

import pytest

from kvtier import LookupResult
from kvtier.tiers.file import HEADER_BYTES, JOURNAL, MANIFEST, SLAB, scan_journal, slot_bytes_for
from reliability_helpers import BLOCK, assert_settled, build, fill_file_tier, payload, read
from conftest import flip

SLOT = slot_bytes_for(BLOCK)


def inspect(root, verify=True, tmp=None) -> dict:
    args = [sys.executable, "-m", "kvtier.cli.main", "inspect", str(root)]
    out_json = os.path.join(tmp or str(root) + ".inspect", "report.json")
    os.makedirs(os.path.dirname(out_json), exist_ok=True)
    args += ["--json", out_json] + (["--verify"] if verify else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(open(out_json).read())


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
])
def test_bit_flip_is_never_served(written, where, reason):
    root, on_disk, _ = written
    slot = sorted(on_disk)[2]
    offset = {"payload": HEADER_BYTES + 100, "payload_last": HEADER_BYTES + BLOCK - 1, "magic": 0,
              "header_crc": 4 + 2 + 2 + 8 + 4 + 8, "key": 40}[where]
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
    served = serve_all(root, fingerprint="model-b/layout-1")
    assert served == {}
    report = inspect(root)
    assert report["fingerprint"] == "model-b/layout-1" and report["blocks"] == 0
    # and model A does not get its blocks back either: they were not ours to keep
    assert serve_all(root) == {}


def test_manifest_of_another_block_geometry_starts_empty(written):
    root, _, _ = written
    h = build(root, block_bytes=2 * BLOCK)
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
    body = struct.pack("<BxHQI", 1, len(forged_key), slot, 0) + forged_key
    record = struct.pack("<I", zlib.crc32(body)) + body
    data = bytearray((root / JOURNAL).read_bytes())
    end = scan_journal(bytes(data)).good_bytes  # where the next record would go
    data[end:end + len(record)] = record
    (root / JOURNAL).write_bytes(bytes(data))
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
    report = inspect(tmp_path / "junk", tmp=str(tmp_path / "out"))
    assert "no readable manifest" in report["index_health"] and report["blocks"] == 0


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
