"""Nothing lost under the default cascade (`on_evict`, issue 42, item 1): a block not yet copied
below is never evicted to make room. The first tier answers "no room yet" instead (the standalone
`store` waits for the copies, vLLM's scheduler asks again), so after a `flush` every block stored
is found, whatever the order of stores, re-offers and threads."""

from __future__ import annotations

import random
import threading

import pytest

from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, load_config_text, make_offload_key
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")

PAGE = 32 * 1024  # two tensors: 64 KiB blocks


def make_kv(num_blocks: int) -> CanonicalKVCaches:
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randint(-128, 128, (num_blocks, PAGE), dtype=torch.int8, generator=g) for _ in range(2)]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                             [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]])


def keys(n: int, start: int = 0) -> list[bytes]:
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(start, start + n)]


def cpu_over_file(root, cascade: str = "on_evict", cpu_blocks: int = 32, file_blocks: int = 512):
    return load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: {cpu_blocks} blocks, pin: false, cascade: {cascade}}}
  - {{name: nvme, backend: file, root_dir: {root}, capacity: {file_blocks} blocks}}
""")


def lost(tier: KVTier, ks: list[bytes]) -> list[int]:
    return [i for i, k in enumerate(ks) if tier.lookup([k]) == 0]


def test_the_issue_sequence_loses_no_block(tmp_path):
    """Nine stores of 7 keys starting at 0, 7, 14, 21, 28, 0, 35, 7, 42 into a 32-block CPU tier
    over a file tier (49 distinct keys): on 7e6c7c1 keys 1, 14 and 15 were gone after the flush,
    counted only as `cascade_dropped` 3."""
    kv = make_kv(64)
    ks = keys(49)
    with KVTier.open(cpu_over_file(tmp_path / "nvme"), kv, model="test/lost") as tier:
        for start in (0, 7, 14, 21, 28, 0, 35, 7, 42):
            assert tier.store(ks[start:start + 7], list(range(start, start + 7)))
        assert tier.flush() == 0
        assert lost(tier, ks) == []
        cpu = tier.stats()["cpu"]
        assert cpu["cascade_dropped"] == cpu["cascade_dropped_failed"] == cpu["cascade_dropped_full"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_re_storing_earlier_chunks_loses_no_block(tmp_path, seed):
    """Chunks of 200 keys stored in order, each store followed by a re-store of a chunk from 2-12
    stores earlier (17-69 of 200 were lost on 7e6c7c1, by pattern)."""
    rng = random.Random(seed)
    kv = make_kv(200)
    ks = keys(200)
    chunks = [list(range(i, min(i + 8, 200))) for i in range(0, 200, 8)]
    with KVTier.open(cpu_over_file(tmp_path / "nvme"), kv, model="test/lost") as tier:
        for n, chunk in enumerate(chunks):
            assert tier.store([ks[i] for i in chunk], chunk)
            if n >= 2:
                again = chunks[n - rng.randint(2, min(12, n))]
                assert tier.store([ks[i] for i in again], again)
        assert tier.flush() == 0
        assert lost(tier, ks) == [] and tier.stats()["cpu"]["cascade_dropped"] == 0


def test_two_threads_storing_overlapping_keys_lose_no_block(tmp_path):
    """Two threads storing overlapping sets of 200 keys (11-38 lost on 7e6c7c1)."""
    kv = make_kv(200)
    ks = keys(200)
    errors: list[BaseException] = []
    with KVTier.open(cpu_over_file(tmp_path / "nvme"), kv, model="test/lost") as tier:
        def run(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    start = rng.randrange(0, 192)
                    span = list(range(start, min(200, start + rng.randint(1, 12))))
                    assert tier.store([ks[i] for i in span], span)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for i in range(0, 200, 16):  # and every key at least once
            assert tier.store(ks[i:i + 16], list(range(i, min(200, i + 16))))
        assert tier.flush() == 0
        assert lost(tier, ks) == [] and tier.stats()["cpu"]["cascade_dropped"] == 0


def test_a_corrupted_file_block_is_a_miss_for_that_block_alone(tmp_path):
    """Issue 42, item 2: 200 blocks stored, closed, one payload byte of one slot flipped, reopened.
    Every load spanning the bad block returns the prefix before it; the block is dropped from the
    file tier, counted once in its `failures`, and a MISS from then on; the others load. On
    7e6c7c1 the first load returned 0 and every later one 0 as well, `lookup` still counted the
    block and the file tier's `failures` stayed 0."""
    from kvtier.tiers.file.slot_format import HEADER_BYTES

    kv = make_kv(400)
    ks = keys(200)
    config = cpu_over_file(tmp_path / "nvme", file_blocks=256)
    with KVTier.open(config, kv, model="test/poison") as tier:
        assert tier.store(ks, list(range(200)))
        disk = tier.hierarchy.manager.tiers[1].backend
        slot = next(s for s, k in disk.committed().items() if k == ks[57])
        path, slot_bytes = disk.slab_path, disk.slot_bytes
    with open(path, "r+b") as f:
        f.seek(slot * slot_bytes + HEADER_BYTES + 100)
        byte = f.read(1)[0]
        f.seek(slot * slot_bytes + HEADER_BYTES + 100)
        f.write(bytes([byte ^ 0xFF]))
    with KVTier.open(config, kv, model="test/poison") as tier:
        for _ in range(2):
            assert tier.load(ks, list(range(200, 400))) == 57
        assert tier.lookup(ks) == 57 and tier.lookup(ks[58:]) == 142
        assert tier.stats()["nvme"]["failures"] == 1
        assert tier.load(ks[58:], list(range(200, 342))) == 142
        for t in kv.tensors:
            assert torch.equal(t.tensor[200:342], t.tensor[58:200])
