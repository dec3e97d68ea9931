"""Each backend states its own capacity rule (`Backend.capacity_problem`), and the build asks the
backend class, whatever name the config gives it."""

from __future__ import annotations

import pytest

from kvtier import ConfigError, build_hierarchy, load_config_text
from kvtier.tiers.base import Backend
from kvtier.tiers.cpu import CPUBackend
from kvtier.tiers.file import FileBackend
from kvtier.tiers.memory import MemoryBackend
from kvtier.tiers.remote import ValkeyBackend

HUGE = 900 << 40  # 900TiB: more than any test machine's memory, /dev/shm or disk


def test_host_memory_tiers_refuse_more_than_the_machine_has():
    for cls in (CPUBackend, MemoryBackend):
        problem = cls.capacity_problem(HUGE, {})
        assert problem is not None and problem.startswith("900TiB is more than the ")
        assert problem.endswith("; lower the capacity")
        assert cls.capacity_problem(4096, {}) is None


def test_the_cpu_tier_names_its_shm_directory_or_memory():
    problem = CPUBackend.capacity_problem(HUGE, {})
    assert "available memory" in problem or "free space in /dev/shm" in problem


def test_the_file_tier_compares_with_the_free_space_of_its_root_dir(tmp_path):
    root = tmp_path / "tier"  # not made yet: its parent's filesystem counts
    problem = FileBackend.capacity_problem(HUGE, {"root_dir": str(root)})
    assert problem is not None and problem.startswith(f"900TiB does not fit on the filesystem of {root} (")
    assert FileBackend.capacity_problem(4096, {"root_dir": str(root)}) is None
    assert not root.exists()


def test_backends_without_a_rule_accept_any_size():
    assert Backend.capacity_problem(HUGE, {}) is None
    assert ValkeyBackend.capacity_problem(HUGE, {"url": "redis://127.0.0.1:1"}) is None


@pytest.mark.parametrize("backend", ["cpu", "kvtier.tiers.cpu:CPUBackend"])
def test_the_build_asks_the_backend_class_whatever_its_name_in_the_config(backend):
    """Before, the rule was chosen by the name `cpu`: a CPU tier named by its class path was built
    without its memory being checked."""
    config = load_config_text(f"block_bytes: 1MiB\ntiers:\n  - {{name: cpu, backend: '{backend}', "
                              f"capacity: 900TiB}}\n")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: 900TiB is more than the "):
        build_hierarchy(config)
