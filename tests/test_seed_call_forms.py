"""The seed's call forms (seed 002's `LRUOffloadingManager`: no request context; issue 42, item 5)
work on kvtier's managers as vLLM's do: `prepare_store(block_hashes)`, `prepare_store(keys, None)`,
`complete_store(block_hashes, success)` with the outcome second. On 7e6c7c1 the first raised
TypeError on `LRUOffloadingManager`, the second AttributeError (request_access), and the third made
a failed store readable on `HierarchyManager` (the outcome was taken for a request context)."""

from __future__ import annotations

import pytest
from conftest import keys, memory_hierarchy

from kvtier import LookupResult, LRUOffloadingManager
from kvtier.tiers.memory import SlotBackend


@pytest.fixture(params=["lru_manager", "hierarchy"])
def manager(request):
    if request.param == "lru_manager":
        yield LRUOffloadingManager(SlotBackend("cpu", 4, 0, block_size=16))
        return
    h = memory_hierarchy(hot=4, warm=16)
    yield h.manager
    h.close()


def test_the_seed_program_runs_without_request_contexts(manager):
    k = keys(6)
    out = manager.prepare_store(k[:2])  # the seed's form
    assert list(out.keys_to_store) == k[:2]
    manager.complete_store(k[:2])
    assert [manager.lookup(key) for key in k[:2]] == [LookupResult.HIT] * 2
    manager.prepare_load(k[:2])
    manager.touch(k[:2])
    manager.complete_load(k[:2])
    out = manager.prepare_store(k[2:4], None)  # vLLM's form with no request
    manager.complete_store(out.keys_to_store, None)
    assert [manager.lookup(key, None) for key in k[2:4]] == [LookupResult.HIT] * 2
    manager.on_request_finished(None)  # (no request: nothing to apply)


def test_the_seed_form_of_a_failed_store_frees_its_blocks(manager):
    k = keys(2, start=10)
    manager.prepare_store(k)
    manager.complete_store(k, False)  # the seed's `complete_store(block_hashes, success)`
    assert [manager.lookup(key) for key in k] == [LookupResult.MISS] * 2
    out = manager.prepare_store(keys(4, start=20))  # their slots are free again
    assert list(out.evicted_keys) == []
