"""`GPUFileHandler` loading for one tensor-parallel rank (issue 38): its layout owns bytes
`[r*P, (r+1)*P)` of each slot; it stages only that range, reads it from the file tier through a
`SlabReader` of that part (verified against the slot's part table) and from host regions, and
scatters it into the rank's own KV cache. A block whose part fails verification is not scattered
(its engine pages untouched), the other blocks are."""

from __future__ import annotations

import pytest
from conftest import flip

from kvtier import CanonicalKVCacheRef, CanonicalKVCacheTensor, FileLoadStoreSpec, GPULoadStoreSpec
from kvtier.core.errors import BlocksFailed
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.tiers.file import FileBackend
from kvtier.tiers.file.reader import SlabReader
from kvtier.tiers.file.slot_format import HEADER_BYTES
from kvtier.tiers.memory import MemoryBackend
from kvtier.transfer.handlers.gpu_cpu import ChunkedKVCaches, KVLayout
from kvtier.transfer.handlers.gpu_file import GPUFileHandler, StagedLoadSpec

torch = pytest.importorskip("torch")

PAGE, BPC, WORLD, ENGINE_BLOCKS = 4096, 2, 2, 12
P = PAGE * BPC  # one rank's bytes of a block


def _rank_kv(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    tensor = torch.randint(-128, 128, (ENGINE_BLOCKS, PAGE), dtype=torch.int8, generator=g)
    return ChunkedKVCaches([CanonicalKVCacheTensor(tensor, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]], BPC,
                           rank * P, P)


def _blocks(kvs, engine_blocks: list[int]) -> list[bytes]:
    """Whole blocks as every rank's store would make them: rank r's pages at bytes [r*P, (r+1)*P)."""
    out = []
    for first in engine_blocks:
        out.append(b"".join(bytes(kv.tensors[0].tensor[first:first + BPC].numpy().tobytes()) for kv in kvs))
    return out


@pytest.fixture
def ranks(tmp_path):
    kvs = [_rank_kv(r) for r in range(WORLD)]
    disk = FileBackend("disk", 8, WORLD * P, root_dir=str(tmp_path / "disk"), fingerprint="m", io="posix",
                       part_checks=WORLD)
    host = MemoryBackend("cpu", 4, WORLD * P)
    readers = [SlabReader("disk", str(disk.root), disk.manifest, (r, WORLD)) for r in range(WORLD)]
    handlers = [GPUFileHandler({"disk": readers[r], "cpu": host}, KVLayout(kvs[r], BPC, r * P, P), to_file=False)
                for r in range(WORLD)]
    yield kvs, disk, host, handlers
    for handler, reader in zip(handlers, readers):
        handler.shutdown()
        reader.close()
    disk.close()
    host.close()


def test_each_rank_loads_its_part_of_file_and_cpu_slots(ranks):
    kvs, disk, host, handlers = ranks
    data = _blocks(kvs, [0, 2, 4])
    disk.write_blocks([5, 1], [b"a", b"c"], [data[0], data[2]])
    host.view(3)[:] = data[1]  # the middle block is in the CPU tier
    source = StagedLoadSpec([(FileLoadStoreSpec([5, 1], [b"a", b"c"], tier="disk"), [0, 2]),
                             (CPULoadStoreSpec([3], tier="cpu"), [1])])
    dst = GPULoadStoreSpec(list(range(6, 12)), group_sizes=[6], block_indices=[0])
    for r, (kv, handler) in enumerate(zip(kvs, handlers)):
        before = kv.tensors[0].tensor[0:6].clone()
        kv.tensors[0].tensor[6:12] = 0
        assert handler.finish_load(*handler.stage_load(source, dst)) == 3 * P
        assert torch.equal(kv.tensors[0].tensor[6:12], before), f"rank {r}"


def test_one_ranks_part_corrupted_fails_that_block_on_that_rank_only(ranks):
    kvs, disk, host, handlers = ranks
    disk.write_blocks([0, 1], [b"x", b"y"], _blocks(kvs, [0, 2]))
    flip(disk.slab_path, 1 * disk.slot_bytes + HEADER_BYTES + P + 100)  # rank 1's part of slot 1
    source = FileLoadStoreSpec([0, 1], [b"x", b"y"], tier="disk")
    dst = GPULoadStoreSpec([8, 9, 10, 11], group_sizes=[4], block_indices=[0])
    originals = [kv.tensors[0].tensor[0:4].clone() for kv in kvs]
    for kv in kvs:
        kv.tensors[0].tensor[8:12] = 0
    assert handlers[0].finish_load(*handlers[0].stage_load(source, dst)) == 2 * P  # rank 0's bytes verified
    assert torch.equal(kvs[0].tensors[0].tensor[8:12], originals[0])
    staged = handlers[1].stage_load(source, dst)
    with pytest.raises(BlocksFailed, match="part 1 checksum mismatch") as failed:
        handlers[1].finish_load(*staged)
    assert failed.value.positions == (1,)
    assert torch.equal(kvs[1].tensors[0].tensor[8:10], originals[1][0:2])  # its good block loaded
    assert not kvs[1].tensors[0].tensor[10:12].any()  # the bad one's pages untouched


def test_an_engine_to_file_handler_needs_a_layout_that_owns_whole_slots():
    with pytest.raises(ValueError, match="writes whole slots"):
        GPUFileHandler({}, KVLayout(_rank_kv(1), BPC, P, P), to_file=True)
