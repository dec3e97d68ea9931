"""What `kvtier config check` prints for a valid hierarchy: a capacity once, and for each tier only
what applies to it (no reserve without an `on_evict` cascade to use it, no cascade or reserve for a
shared tier, no unset options). On a8dbffc it printed `capacity=10000 blocks = 10000 blocks` and a
reserve for the valkey tier."""

from __future__ import annotations

from kvtier.cli.main import main

YAML = """block_tokens: 16
tiers:
  - {name: cpu, backend: cpu, capacity: 10000 blocks}
  - {name: nvme, backend: file, capacity: 1GiB, root_dir: /tmp/kvtier-describe-never-created}
  - {name: shared, backend: valkey, capacity: 500 blocks, url: 'redis://127.0.0.1:6379'}
"""


def describe(tmp_path, capsys, *flags: str) -> list[str]:
    path = tmp_path / "tiers.yaml"
    path.write_text(YAML)
    assert main(["config", "check", str(path), *flags]) == 0
    return capsys.readouterr().out.splitlines()


def test_each_tier_shows_what_applies_to_it(tmp_path, capsys):
    _, cpu, nvme, shared = describe(tmp_path, capsys)[:4]
    assert "capacity=10000 blocks, policy=prefix-freq, reserve=0.1" in cpu and "= 10000 blocks" not in cpu
    assert cpu.endswith("-> cascade on_evict to nvme")
    assert "capacity=1GiB, policy=lru, root_dir=" in nvme and "reserve" not in nvme and "cascade" not in nvme
    assert "capacity=500 blocks (handles of keys on the server), policy=lru (which handles to forget)" in shared
    assert "reserve" not in shared and "username" not in shared and "None" not in shared


def test_a_byte_capacity_is_resolved_into_blocks_once(tmp_path, capsys):
    nvme = describe(tmp_path, capsys, "--block-bytes", "1MiB")[2]
    assert "capacity=1GiB = 1024 blocks, policy=lru" in nvme


def test_the_block_size_given_is_checked_as_the_configs_own(tmp_path, capsys):
    """Before: --block-bytes only changed the printout: 4GiB of 1-byte blocks (past lru's limit)
    and 1KiB of 1MiB blocks ("= 0 blocks") passed with exit 0."""
    for capacity, block, says in (("4GiB", "1B", "more than policy 'lru' can hold"),
                                  ("1KiB", "1MiB", "smaller than one block (1MiB)")):
        path = tmp_path / "tier.yaml"
        path.write_text(f"tiers:\n  - {{name: cpu, backend: memory, capacity: {capacity}, policy: lru}}\n")
        assert main(["config", "check", str(path), "--block-bytes", block]) == 2
        assert says in capsys.readouterr().err
