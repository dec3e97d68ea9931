"""One limit for identities (issue 36.5): `kvtier.core.limits.MAX_IDENTITY_BYTES`.

On 7e6c7c1 `KVTier.open(..., model="org/m@" + "r" * 1_100_000)` was accepted and lost every block
on a clean close (its manifest was past the 1 MiB the file tier reads back), and an inline
`fingerprint` of 50 MB passed `parse_config`. Now an identity past the limit is refused where it
is given (`model`, `tiers[i].fingerprint`, under vLLM too), and every file the file tier writes
with identities, layout and keys at their limits reads back within kvtier's own read bounds.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from test_identity import KEYS, NUM_KEYS, config, make_kv

from kvtier import ArgumentError, ConfigError, KVTierError, make_offload_key, parse_config
from kvtier.config.vllm import vllm_hierarchy_config
from kvtier.control.hierarchy import describe_layout
from kvtier.core.limits import MAX_IDENTITY_BYTES
from kvtier.standalone import KVTier
from kvtier.tiers.file import FileBackend
from kvtier.tiers.file.inspection import inspect_root
from kvtier.tiers.file.journal import Journal, journal_capacity, read_journal
from kvtier.tiers.file.manifest import MANIFEST_MAX_BYTES, load_manifest
from kvtier.tiers.file.rootdir import JOURNAL, LOCK, MANIFEST
from kvtier.tiers.file.rootlock import RootLock
from kvtier.tiers.file.slot_format import MAX_KEY_BYTES

# The worst case for a JSON manifest: control characters (6 bytes each escaped) and characters
# outside the BMP (4 bytes of UTF-8, 12 escaped), MAX_IDENTITY_BYTES of UTF-8 in all.
WORST = "\x01" * (MAX_IDENTITY_BYTES // 2) + "\U0001F600" * (MAX_IDENTITY_BYTES // 8)


def raw_config(root, fingerprint):
    return {"tiers": [{"name": "cpu", "backend": "memory", "capacity": "4 blocks"},
                      {"name": "nvme", "backend": "file", "capacity": "4 blocks", "root_dir": str(root),
                       "fingerprint": fingerprint}]}


def test_a_model_past_the_limit_is_refused_at_open_before_anything_is_built(tmp_path):
    root = tmp_path / "kv"
    with pytest.raises(ArgumentError, match=rf"^model: 1100006 characters, more than the {MAX_IDENTITY_BYTES} bytes"):
        KVTier.open(config(root), make_kv(), model="org/m@" + "r" * 1_100_000)
    assert not root.exists()


def test_a_model_at_the_limit_keeps_every_block_across_a_clean_close(tmp_path):
    """The issue's scenario within the limit: store, close, reopen, every block loads."""
    model = "org/m@" + "r" * (MAX_IDENTITY_BYTES - 6)
    root = tmp_path / "kv"
    with KVTier.open(config(root), make_kv(), model=model) as tier:
        assert tier.store(KEYS, list(range(NUM_KEYS))) and tier.flush() == 0
    with KVTier.open(config(root), make_kv(seed=1), model=model) as tier:
        assert tier.load(KEYS, list(range(NUM_KEYS, 2 * NUM_KEYS))) == NUM_KEYS


def test_a_fingerprint_past_the_limit_is_refused_quickly_naming_the_field(tmp_path):
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        parse_config(raw_config(tmp_path, "f" * 50_000_000))
    assert time.perf_counter() - start < 1.0
    [(field, message)] = info.value.problems
    assert field == "tiers[1].fingerprint" and f"more than the {MAX_IDENTITY_BYTES} bytes" in message
    assert "'org/model@revision'" in message and len(message) < 400
    for bad, why in (("\ud800", "not UTF-8 text"), ("é" * (MAX_IDENTITY_BYTES // 2 + 1), "bytes (UTF-8)")):
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.fingerprint: .*" + re.escape(why)):
            parse_config(raw_config(tmp_path, bad))
    assert parse_config(raw_config(tmp_path, WORST)).tiers[1].options["fingerprint"] == WORST


def test_fingerprint_and_model_together_past_the_limit_are_refused_naming_the_field(tmp_path):
    cfg = parse_config(raw_config(tmp_path / "kv", "f" * (MAX_IDENTITY_BYTES - 2)))
    with pytest.raises(ConfigError) as info:
        KVTier.open(cfg, make_kv(), model="org/model")
    [(field, message)] = info.value.problems
    assert field == "tiers[1].fingerprint" and "joined by ' | '" in message and "a short identity" in message
    assert not (tmp_path / "kv").exists()


def test_an_identity_derived_under_vllm_past_the_limit_is_refused_naming_the_field(tmp_path):
    served = "vllm:model=" + "m" * MAX_IDENTITY_BYTES + ":dtype=float16"
    raw = {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "4 blocks"},
                     {"name": "nvme", "backend": "file", "capacity": "4 blocks", "root_dir": str(tmp_path)}]}
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.fingerprint: .* characters, more than"):
        vllm_hierarchy_config(raw, block_tokens=16, engine_id="e", fingerprint=served)


class _Tensor:
    def __init__(self, dims):
        self.dtype, self.shape = "torch.float16", [8, *dims]


class _Caches:
    def __init__(self, n):  # n tensors, each of its own shape: nothing to count as a run
        self.tensors = [type("T", (), {"tensor": _Tensor((i, 2)), "page_size_bytes": 64})() for i in range(n)]
        self.group_data_refs = [[type("R", (), {"tensor_idx": i, "page_size_bytes": 64})() for i in range(0, n, 2)]]


def test_a_layout_past_the_limit_is_cut_to_it_with_a_digest_of_the_whole():
    long_one, other = describe_layout(4096, 16, _Caches(5000)), describe_layout(4096, 16, _Caches(5001))
    assert len(long_one.encode()) == MAX_IDENTITY_BYTES and long_one != other
    assert long_one.startswith("block_bytes=4096 block_tokens=16") and ", blake2b " in long_one
    assert len(describe_layout(4096, 16, _Caches(4))) < 200


def test_every_file_the_file_tier_writes_at_the_limits_reads_back(tmp_path, monkeypatch):
    """Identity and layout of MAX_IDENTITY_BYTES with the worst JSON escaping, keys of the most a
    slot holds, the highest pid: the manifest, journal, slab and lock all read back within the
    bounds kvtier reads them with (a reopen and `kvtier inspect --verify`)."""
    root = tmp_path / "kv"
    layout = describe_layout(4096, 16, _Caches(5000))
    keys = [make_offload_key(bytes([i]) * (MAX_KEY_BYTES - 4), 0) for i in range(8)]
    monkeypatch.setattr(os, "getpid", lambda: 4194304)  # pid_max's highest value on Linux (2^22)
    backend = FileBackend("nvme", 8, 4096, 16, root_dir=str(root), io="posix", fingerprint=WORST, layout=layout)
    assert backend.write_blocks(list(range(8)), keys, [bytes([i]) * 4096 for i in range(8)]) == 8 * 4096
    assert (root / LOCK).read_text() == "4194304\n"
    assert inspect_root(str(root))["lock_holder"]["pid"] == 4194304
    with pytest.raises(KVTierError, match=r"in use by another process \(pid 4194304\)"):
        RootLock(root)
    backend.close()
    monkeypatch.undo()
    assert (root / MANIFEST).stat().st_size <= MANIFEST_MAX_BYTES
    manifest, problem = load_manifest(root)
    assert problem is None and manifest is not None and (manifest["fingerprint"], manifest["layout"]) == (WORST, layout)
    report = inspect_root(str(root), verify=True)
    assert (report["blocks"], report["verified_ok"], report["verify_failed"]) == (8, 8, 0)
    backend = FileBackend("nvme", 8, 4096, 16, root_dir=str(root), io="posix", fingerprint=WORST, layout=layout)
    try:
        out = [bytearray(4096) for _ in range(8)]
        assert backend.read_blocks(list(range(8)), keys, out) == 8 * 4096
        assert [bytes(o) for o in out] == [bytes([i]) * 4096 for i in range(8)]
    finally:
        backend.close()


def test_the_largest_journal_a_tier_writes_reads_back(tmp_path):
    """Every slot's record with the longest key, compacted (a journal twice what they need)."""
    num_slots = 1000
    capacity = journal_capacity(num_slots, FileBackend.compact_min_records)
    entries = [(slot, slot.to_bytes(4, "big") * (MAX_KEY_BYTES // 4), slot) for slot in range(num_slots)]
    Journal.create(tmp_path / JOURNAL, bytes(16), capacity=capacity).compacted(entries, capacity).close()
    scan = read_journal(tmp_path / JOURNAL, num_slots, capacity)
    assert scan.problem is None and len(scan.entries) == num_slots
    assert json.dumps(sorted(scan.entries)) == json.dumps(list(range(num_slots)))


def test_a_manifest_that_would_not_read_back_is_never_written(tmp_path):
    from kvtier.tiers.file.manifest import write_manifest
    with pytest.raises(ValueError, match=rf"{tmp_path / MANIFEST}: a manifest of \d+ bytes would not be read back"):
        write_manifest(tmp_path, {"fingerprint": "x" * MANIFEST_MAX_BYTES, "layout": ""})
    assert not (tmp_path / MANIFEST).exists()
