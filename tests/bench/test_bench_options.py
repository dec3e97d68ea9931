"""`kvtier bench`'s numeric options are checked before anything runs: exit 2, the option, the value
and the allowed range, no traceback."""

from __future__ import annotations

import pytest

from kvtier.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "--capacities", "99999999999999", "trace"],
     "--capacities: 99999999999999 is out of range: a block count is from 1 to 1,000,000,000,000"),
    (["bench", "trace", "--capacities", "2000000m"], "--capacities: 2000000m is out of range"),
    (["bench", "trace", "--capacities", "1e400"], "--capacities: '1e400' is not a block count"),
    (["bench", "trace", "--capacities", "inf"], "--capacities: 'inf' is not a block count"),
    (["bench", "trace", "--capacities", "0"], "--capacities: 0 is out of range: a block count is from 1"),
    (["bench", "hops", "--block-sizes", "0B"], "--block-sizes: size must be > 0, got '0B'"),
    (["bench", "hops", "--block-sizes", "64KiB,2GiB"],
     "--block-sizes: '2GiB' is out of range: a block size is from 1B to 1GiB"),
    (["bench", "hops", "--block-sizes", ","], "--block-sizes: no block size given"),
    (["bench", "--repeats", "1001"], "--repeats: 1001 is out of range: from 1 to 1000"),
    # empty values (before: the default sweep ran)
    (["bench", "trace", "--capacities", ""], "--capacities: no block counts given"),
    (["bench", "--capacities", " "], "--capacities: no block counts given"),
    (["bench", "trace", "--policies", ""], "--policies: no policy given"),
    (["bench", "trace", "--policies", " , "], "--policies: no policy given"),
    (["bench", "--policies", ""], "--policies: no policy given"),
    (["bench", "hops", "--block-sizes", ""], "--block-sizes: no block size given"),
    (["bench", "--block-sizes", ""], "--block-sizes: no block size given"),
])
def test_out_of_range_values_are_refused_up_front(capsys, monkeypatch, argv, message):
    monkeypatch.setattr("kvtier.cli.bench.load_config", lambda path: pytest.fail("the config was read first"))
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_capacity_past_a_policy_limit_is_a_clear_error(capsys, monkeypatch):
    # The compiled lru index refuses more than 2**30 blocks (it is not built on every machine, so its
    # refusal is reproduced here); the pure-Python fallback has no such limit.
    def refuse(config, **kwargs):
        raise ValueError(f"cache_capacity must be <= 1073741824 blocks for lru, got {config.tiers[0].capacity.blocks}")

    monkeypatch.setattr("kvtier.control.hierarchy.build_hierarchy", refuse)
    assert main(["bench", "trace", "--capacities", "2000000000", "--config", "configs/memory.yaml",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert ("--capacities: tier 'hot' of 2,000,000,000 blocks with policy 'arc' cannot be built (ValueError: "
            "cache_capacity must be <= 1073741824 blocks for lru, got 2000000000); give a smaller capacity") in err
    assert "Traceback" not in err
