"""The file-tier benchmarks put their root_dir into YAML as a quoted string, so a directory
whose name YAML would otherwise read as syntax (`'`, `,`, `: `, ` #`) still configures the tier."""

from __future__ import annotations

from kvtier.bench import crash, file_hops
from kvtier.config import load_config_text

ODD_NAME = "it's, odd: dir #1"


def test_crash_config_keeps_an_odd_root_dir(tmp_path):
    root = tmp_path / ODD_NAME
    root.mkdir()
    config = load_config_text(crash.config_text(str(root), "memory"))
    assert config.tiers[1].options["root_dir"] == str(root)
    hierarchy = crash.build(str(root), "memory")
    try:
        assert hierarchy.manager.tiers[1].name == "disk"
    finally:
        hierarchy.close()
    assert (root / "lock").exists()  # the tier was opened in the odd directory itself


def test_measure_restart_runs_under_an_odd_root_dir(tmp_path):
    root = tmp_path / ODD_NAME
    root.mkdir()
    figures = file_hops.measure_restart(str(root), num_blocks=64, block_bytes=256)
    assert figures["num_blocks"] == 64
    assert figures["journal_records"] >= 128  # each block written twice (1 rewrite)
    assert list(root.iterdir()) == []  # its work directory was removed


def test_the_crash_config_takes_a_path_object_as_the_reliability_tests_pass_it(tmp_path):
    root = tmp_path / "it's, odd: dir #1"
    config = load_config_text(crash.config_text(root, "memory"))
    assert config.tiers[1].options["root_dir"] == str(root)
