import pytest

from kvtier import (
    BlockStatus,
    CPULoadStoreSpec,
    FileLoadStoreSpec,
    GPULoadStoreSpec,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)


def test_offload_key_packs_hash_and_group_big_endian():
    key = make_offload_key(b"\x01\x02\x03", 258)
    assert key == b"\x01\x02\x03\x00\x00\x01\x02"
    assert get_offload_block_hash(key) == b"\x01\x02\x03"
    assert get_offload_group_idx(key) == 258


def test_block_status_starts_not_ready_and_tracks_ref_count():
    block = BlockStatus(7)
    assert block.block_id == 7 and block.ref_cnt == -1 and not block.is_ready
    block.ref_cnt = 0
    assert block.is_ready


def test_block_status_many_equals_one_by_one():
    ids = [0, 7, 3, 2**40, 2**63 - 1]
    many = BlockStatus.many(ids)
    assert [type(b) for b in many] == [BlockStatus] * len(ids)
    assert [(b.block_id, b.ref_cnt, b.is_ready) for b in many] == \
        [(b.block_id, b.ref_cnt, b.is_ready) for b in map(BlockStatus, ids)] == [(i, -1, False) for i in ids]
    many[1].ref_cnt += 2  # independent, mutable structures
    assert (many[1].ref_cnt, many[2].ref_cnt) == (1, -1)
    assert BlockStatus.many([]) == []


def test_block_id_specs_reject_negative_ids():
    with pytest.raises(ValueError, match="block_ids must be >= 0"):
        CPULoadStoreSpec([3, -1])
    assert CPULoadStoreSpec([]).block_ids == [] and CPULoadStoreSpec((2, 1)).block_ids == [2, 1]


def test_gpu_spec_defaults_to_one_group():
    spec = GPULoadStoreSpec([4, 5, 6])
    assert spec.group_sizes == [3] and spec.block_indices is None and spec.medium() == "GPU"


@pytest.mark.parametrize("kwargs, message", [
    (dict(group_sizes=[1, 1]), "sum(group_sizes)=2 must equal len(block_ids)=3"),
    (dict(group_sizes=[3], block_indices=[0, 1]), "len(block_indices)=2 must equal the number of groups 1"),
    (dict(group_sizes=[-1, 4]), "group_sizes must be >= 0"),
    (dict(group_sizes=[3], block_indices=[-2]), "block_indices must be >= 0"),
])
def test_gpu_spec_rejects_inconsistent_groups_with_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPULoadStoreSpec([1, 2, 3], **kwargs)


def test_block_id_specs_subset_keeps_tier_and_keys():
    spec = FileLoadStoreSpec([10, 11, 12], [b"a", b"b", b"c"], tier="nvme")
    sub = spec.subset([2, 0])
    assert sub.block_ids == [12, 10] and sub.keys == [b"c", b"a"] and sub.tier == "nvme"
    assert CPULoadStoreSpec([1], tier="cpu").subset([0]).tier == "cpu"
    with pytest.raises(ValueError):
        FileLoadStoreSpec([1, 2], [b"a"])
