"""A backend written to vLLM's seed contract (`Backend(block_size, medium)`) works under kvtier."""

import pytest
from conftest import keys

from kvtier import LookupResult, LRUOffloadingManager, ReqContext
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.core.types import BlockStatus
from kvtier.tiers.base import Backend

CTX = ReqContext("r")


class SeedCPUBackend(Backend):
    """As a vLLM user writes one: its own free list, the seed's base constructor by keyword."""

    spec_type = CPULoadStoreSpec

    def __init__(self, block_size: int, num_blocks: int, positional: bool = False):
        if positional:
            super().__init__(block_size, "CPU")
        else:
            super().__init__(block_size=block_size, medium="CPU")
        self.free_ids = list(range(num_blocks))

    def get_num_free_blocks(self):
        return len(self.free_ids)

    def allocate_blocks(self, block_hashes):
        return [BlockStatus(self.free_ids.pop()) for _ in block_hashes]

    def free(self, block):
        self.free_ids.append(block.block_id)

    def get_load_store_spec(self, block_hashes, blocks):
        return CPULoadStoreSpec([b.block_id for b in blocks])


@pytest.mark.parametrize("positional", [False, True])
def test_a_seed_backend_calls_its_base_constructor_and_serves_the_lru_manager(positional):
    backend = SeedCPUBackend(16, 2, positional)
    assert (backend.block_size, backend.medium) == (16, "CPU")
    m = LRUOffloadingManager(backend, enable_events=True)
    k = keys(3)
    m.complete_store(m.prepare_store(k[:2], CTX).keys_to_store, CTX)
    out = m.prepare_store([k[2]], CTX)
    assert out.keys_to_store == [k[2]] and out.evicted_keys == [k[0]]
    m.complete_store(out.keys_to_store, CTX)
    assert m.lookup(k[2], CTX) is LookupResult.HIT
    assert [(e.medium, e.block_size) for e in m.take_events()] == [("CPU", 16)] * 3


def test_kvtiers_slot_defaults_refuse_clearly_on_a_seed_backend():
    class Partial(Backend):
        spec_type = CPULoadStoreSpec

        def __init__(self):
            super().__init__(block_size=16, medium="CPU")

    with pytest.raises(NotImplementedError, match="must implement get_num_free_blocks"):
        Partial().get_num_free_blocks()


def test_kvtiers_own_form_still_needs_a_slot_count():
    class Mine(Backend):
        spec_type = CPULoadStoreSpec
        medium = "CPU"

    assert Mine("mine", 4, 64).get_num_free_blocks() == 4
    with pytest.raises(ValueError, match="at least one slot"):
        Mine("mine", 0, 64)
    with pytest.raises(TypeError, match="Backend"):
        Mine(4, 4, 64)  # type: ignore[arg-type]
