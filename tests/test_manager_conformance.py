"""`kvtier.testing.manager.ManagerTests` on every shipped manager, and on broken ones (which must fail it)."""

from __future__ import annotations

import pytest

from kvtier import LookupResult, LRUOffloadingManager, build_hierarchy, load_config_text
from kvtier.core.types import OffloadingEvent, PrepareStoreOutput
from kvtier.testing.manager import ManagerTests
from kvtier.tiers.memory import MemoryBackend, SlotBackend


class TestLRUManager(ManagerTests):
    def make_manager(self, tmp_path):
        return LRUOffloadingManager(SlotBackend("cpu", 8, 0, block_size=16), enable_events=True)

    def capacities(self, manager):
        return {manager.backend.medium: manager.backend.num_blocks}


class TestLRUManagerOverMemory(TestLRUManager):
    def make_manager(self, tmp_path):
        return LRUOffloadingManager(MemoryBackend("cpu", 6, 64), enable_events=True)


class HierarchySuite(ManagerTests):
    """A hierarchy built from YAML, like users build it."""

    yaml = ""

    def make_manager(self, tmp_path):
        config = load_config_text(self.yaml.replace("{root}", str(tmp_path / "nvme")))
        self.hierarchy = build_hierarchy(config, enable_events=True, model="conformance")
        return self.hierarchy.manager

    def capacities(self, manager):
        return {tier.name: tier.capacity for tier in manager.tiers}


def memory_yaml(policy: str, cascade: str) -> str:
    return f"""
block_bytes: 64B
tiers:
  - {{name: hot, backend: memory, capacity: 6 blocks, policy: {policy}, cascade: {cascade}, reserve: 0.34}}
  - {{name: warm, backend: memory, capacity: 14 blocks, policy: lru}}
"""


def _hierarchy_classes():
    """One suite per (cascade mode, tier-0 policy) over two memory tiers."""
    classes = {}
    for cascade in ("on_evict", "on_store", "none"):
        for policy in ("lru", "arc", "sieve", "prefix-freq"):
            name = f"TestHierarchy_{cascade}_{policy.replace('-', '_')}"
            classes[name] = type(name, (HierarchySuite,), {"yaml": memory_yaml(policy, cascade)})
    return classes


globals().update(_hierarchy_classes())


class TestHierarchyCPUFile(HierarchySuite):
    """The shipped default shape: a shared-memory CPU tier in front of a file tier."""

    yaml = """
block_bytes: 4KiB
tiers:
  - {name: cpu, backend: cpu, capacity: 6 blocks, policy: prefix-freq, cascade: on_evict, reserve: 0.34, pin: false}
  - {name: nvme, backend: file, root_dir: "{root}", capacity: 14 blocks, policy: lru, io: posix}
"""


# ---------------------------------------------------------------------- the suite catches broken managers
class EvictsPinned(LRUOffloadingManager):
    """Takes eviction victims among pinned blocks first (ignores ref_cnt > 0)."""

    def prepare_store(self, keys, req_context):
        to_store = [k for k in keys if k not in self.blocks]
        need = len(to_store) - self.backend.get_num_free_blocks()
        if need > 0:
            victims = sorted(self.blocks, key=lambda k: -self.blocks[k].ref_cnt)
            victims = [k for k in victims if self.blocks[k].ref_cnt >= 0][:need]
            if len(victims) < need:
                return None
            for key in victims:
                self.blocks[key].ref_cnt = 0  # forget the pin, as a buggy policy would
            for key in victims:
                self.backend.free(self.blocks.pop(key))
            if self.events is not None:  # (the events the manager's own evictions would make)
                self.events.append(OffloadingEvent(victims, self.backend.block_size, self.backend.medium, True))
            blocks = self.backend.allocate_blocks(to_store)
            self.blocks.update(zip(to_store, blocks))
            return PrepareStoreOutput(to_store, self.backend.get_load_store_spec(to_store, blocks), victims)
        return super().prepare_store(keys, req_context)

    def complete_load(self, keys, req_context):
        for key in keys:
            if key in self.blocks and self.blocks[key].ref_cnt > 0:
                self.blocks[key].ref_cnt -= 1


class ResetKeepsBlocks(LRUOffloadingManager):
    def reset_cache(self):
        return


class HitsEverything(LRUOffloadingManager):
    """Answers HIT for blocks it never stored."""

    def lookup(self, key, req_context):
        result = super().lookup(key, req_context)
        return LookupResult.HIT if result is LookupResult.MISS else result


class BrokenSuite(TestLRUManager):
    manager_cls: type = LRUOffloadingManager

    def make_manager(self, tmp_path):
        return self.manager_cls(SlotBackend("cpu", 8, 0, block_size=16), enable_events=True)


def broken(cls) -> BrokenSuite:
    suite = BrokenSuite()
    suite.manager_cls = cls
    return suite


def test_a_manager_that_evicts_a_pinned_block_fails_the_suite(tmp_path):
    with pytest.raises(AssertionError, match="pinned"):
        broken(EvictsPinned).test_pinned_blocks_are_not_evicted(tmp_path)


def test_a_manager_whose_reset_keeps_blocks_fails_the_suite(tmp_path):
    with pytest.raises(AssertionError, match="still found after reset_cache|no tier holds"):
        broken(ResetKeepsBlocks).test_reset_cache_removes_every_block(tmp_path)


def test_a_manager_that_answers_hit_for_unknown_blocks_fails_the_suite(tmp_path):
    with pytest.raises(AssertionError, match="no tier holds"):
        broken(HitsEverything).test_scheduler_trace(tmp_path)
