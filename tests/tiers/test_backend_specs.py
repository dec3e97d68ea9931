"""`Backend.get_load_store_spec` builds slot-only specs without re-validating the backend's own
slot numbers (issue 19: one spec per request-cycle call); the result must be the spec
`for_blocks` builds, and specs that record more (file keys) or validate differently still go
through their own `for_blocks`."""

from __future__ import annotations

from kvtier.core.keys import make_offload_key
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.core.types import BlockStatus
from kvtier.tiers.base import Backend
from kvtier.tiers.file.spec import FileLoadStoreSpec

KEYS = [make_offload_key(bytes([i]) * 8, 0) for i in range(3)]


class SlotsOnly(Backend):
    spec_type = CPULoadStoreSpec
    medium = "CPU"


class FileSlots(Backend):
    spec_type = FileLoadStoreSpec
    medium = "FILE"


class Checked(CPULoadStoreSpec):
    """A spec subclass with its own constructor: it must still be called."""

    made = 0

    def __init__(self, block_ids, tier=None):
        super().__init__(block_ids, tier)
        Checked.made += 1


class CheckedSlots(Backend):
    spec_type = Checked
    medium = "CPU"


def test_slot_only_spec_equals_the_validated_one():
    backend = SlotsOnly("cpu", 8, 16)
    blocks = BlockStatus.many([5, 0, 7])
    spec = backend.get_load_store_spec(KEYS, blocks)
    want = CPULoadStoreSpec.for_blocks([5, 0, 7], KEYS, tier="cpu")
    assert type(spec) is CPULoadStoreSpec and spec.block_ids == want.block_ids == [5, 0, 7]
    assert spec.tier == want.tier == "cpu" and len(spec) == 3


def test_specs_with_their_own_constructor_or_keys_use_it():
    blocks = BlockStatus.many([1, 2, 3])
    spec = FileSlots("nvme", 8, 16).get_load_store_spec(KEYS, blocks)
    assert type(spec) is FileLoadStoreSpec and spec.keys == KEYS and spec.block_ids == [1, 2, 3]
    before = Checked.made
    spec = CheckedSlots("cpu", 8, 16).get_load_store_spec(KEYS, blocks)
    assert type(spec) is Checked and Checked.made == before + 1 and spec.block_ids == [1, 2, 3]


def _same(a, b) -> bool:
    return (type(a) is type(b) and list(a.block_ids) == list(b.block_ids) and a.tier == b.tier
            and getattr(a, "keys", None) == getattr(b, "keys", None))


def test_spec_for_ids_equals_the_spec_of_the_blocks():
    """`spec_for_ids` (the batch calls' path: block ids, no block objects) builds what
    `get_load_store_spec` builds from blocks of those ids, for every kind of spec above."""
    for backend in (SlotsOnly("cpu", 8, 16), FileSlots("nvme", 8, 16), CheckedSlots("cpu", 8, 16)):
        want = backend.get_load_store_spec(KEYS, BlockStatus.many([4, 0, 6]))
        assert _same(backend.spec_for_ids(KEYS, [4, 0, 6]), want)


def test_spec_for_ids_goes_through_an_overridden_get_load_store_spec():
    """A backend that builds its specs itself gets them built by its own method."""
    seen = []

    class Own(SlotsOnly):
        def get_load_store_spec(self, keys, blocks):
            seen.append([b.block_id for b in blocks])
            return super().get_load_store_spec(keys, blocks)

    spec = Own("cpu", 8, 16).spec_for_ids(KEYS, [2, 3, 1])
    assert seen == [[2, 3, 1]] and spec.block_ids == [2, 3, 1]


def test_free_ids_frees_the_slots_or_goes_through_an_extended_free():
    plain = SlotsOnly("cpu", 8, 16)
    ids = plain.slots.allocate(3)
    plain.free_block_ids(ids[:2])
    assert plain.get_num_free_blocks() == 7
    freed = []

    class Own(SlotsOnly):
        def free(self, block):
            freed.append(block.block_id)
            super().free(block)

    own = Own("cpu", 8, 16)
    own.free_block_ids(own.slots.allocate(2))
    assert freed == [0, 1] and own.get_num_free_blocks() == 8
