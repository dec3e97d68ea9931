"""Shared helpers of the reliability tests: a CPU(or memory) -> FILE hierarchy with key-derived bytes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import tempfile

import pytest

from kvtier import LookupResult, build_hierarchy, load_config_text, make_offload_key
from kvtier.bench import crash

BLOCK = 16 * 1024


def config_text(root, upper="memory", upper_blocks=8, file_blocks=32, fingerprint="model-a/layout-1",
                block_bytes=BLOCK, reserve=0.25):
    """The crash harness's hierarchy, with the upper tier named "up"."""
    return crash.config_text(root, upper, upper_blocks, file_blocks, block_bytes, upper_name="up", reserve=reserve,
                             fingerprint=fingerprint)


def build(root, reset=False, **kw):
    """The hierarchy of `config_text`; `reset`: its file tier erases another identity's blocks
    (`on_identity_change: reset`) instead of refusing to open."""
    text = config_text(root, **kw)
    return build_hierarchy(load_config_text(text + "    on_identity_change: reset\n" if reset else text))


def keys(n, start=0):
    return [make_offload_key(i.to_bytes(8, "big") * 2, 0) for i in range(start, start + n)]


def payload(key, block_bytes=BLOCK) -> bytes:
    return hashlib.shake_128(bytes(key)).digest(block_bytes)


def store(h, batch, wait=True):
    """prepare_store + write key-derived bytes + complete_store; returns the keys stored (may be [])."""
    mgr = h.manager
    out = mgr.prepare_store(batch)
    if out is None:
        return []
    up = h.backends["up"]
    for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
        up.view(slot)[:] = payload(key, up.block_bytes)
    mgr.complete_store(out.keys_to_store)
    mgr.on_schedule_end()
    if wait:
        mgr.wait_idle()
    return list(out.keys_to_store)


def fill_file_tier(h, n, start=0):
    """Store `n` blocks so that they are all readable in the file tier; returns their keys."""
    ks = keys(n, start)
    for k in ks:
        store(h, [k])
    # push the last ones down too: store fillers until every key is in the file tier
    filler = start + 10_000
    disk = h.manager.tiers[1].policy
    while any((b := disk.get(k)) is None or b.ref_cnt < 0 for k in ks):
        store(h, keys(1, filler))
        filler += 1
    return ks


def read(h, key):
    """Serve one block through the manager: HIT (from tier 0) or RETRY -> promotion -> HIT.
    Returns its bytes, or None when the manager answers MISS."""
    mgr = h.manager
    answer = mgr.lookup(key)
    if answer is LookupResult.RETRY:
        mgr.on_schedule_end()
        mgr.wait_idle()
        answer = mgr.lookup(key)
    if answer is LookupResult.MISS:
        return None
    assert answer is LookupResult.HIT, answer
    spec = mgr.prepare_load([key])
    data = bytes(h.backends["up"].view(spec.block_ids[0]))
    mgr.complete_load([key])
    return data


def pinned(mgr) -> list:
    """(tier, key, ref_cnt) of every block that is not idle-readable (pinned or being written)."""
    return [(t.name, bytes(k).hex(), t.policy.get(k).ref_cnt) for t in mgr.tiers for k in list(t.policy.keys())
            if t.policy.get(k).ref_cnt != 0]


def assert_settled(mgr):
    mgr.wait_idle()
    assert pinned(mgr) == [], "blocks left pinned after every job ended"
    assert not mgr.has_pending_work() and all(t.demoting == 0 for t in mgr.tiers)
    for t in mgr.tiers:
        assert len(t.policy) + t.backend.get_num_free_blocks() == t.capacity, f"slot leak in tier {t.name}"


def shm_files(pid=None) -> set[str]:
    pid = os.getpid() if pid is None else pid
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"kvtier-{pid}-")}


@contextlib.contextmanager
def tmpfs(size="4m"):
    """A fresh tmpfs mount (root only); skips the test where mounting is not allowed."""
    mnt = tempfile.mkdtemp(prefix="kvtier-tmpfs-")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", mnt],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)
        os.rmdir(mnt)


def fill_filesystem(path) -> str:
    """Write a file until the filesystem of `path` is full; returns its path."""
    filler = os.path.join(path, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = b"\xff" * 65536
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError:
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)
    return filler
