"""Where `kvtier bench hops` measures the file tier: on the filesystem the config's tier would use."""

from __future__ import annotations

from kvtier import load_config_text
from kvtier.bench.hops_runner import _file_tier_parent


def _config(root_dir: str):
    return load_config_text(f"""
block_bytes: 4KiB
tiers:
  - {{name: cpu, backend: memory, capacity: 8 blocks}}
  - {{name: disk, backend: file, capacity: 16 blocks, root_dir: "{root_dir}", fingerprint: bench}}
""")


def test_a_tier_not_built_yet_is_measured_under_its_nearest_existing_directory(tmp_path):
    # The shipped configs name ~/.cache/kvtier/<tier>: on a fresh machine none of it exists yet.
    root = tmp_path / "home" / ".cache" / "kvtier" / "nvme"
    assert _file_tier_parent(_config(str(root))) == str(tmp_path)
    (tmp_path / "home" / ".cache").mkdir(parents=True)
    assert _file_tier_parent(_config(str(root))) == str(tmp_path / "home" / ".cache")


def test_no_file_tier_means_no_preference():
    config = load_config_text("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n")
    assert _file_tier_parent(config) is None

