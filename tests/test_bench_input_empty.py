"""An option given an empty value is refused (exit 2, the option named), never read as "not given":
`kvtier serve --socket ""` listened on the default socket (the bench options' empty values are
cases of tests/bench/test_bench_options.py), and no value still means the defaults."""

from __future__ import annotations

import signal

import pytest

from kvtier.cli.main import main


def test_an_empty_socket_is_refused(capsys, monkeypatch):
    monkeypatch.setattr("kvtier.host.owner.HostOwner", lambda *a, **k: pytest.fail("the owner was started"))
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    assert main(["serve", "--socket", ""]) == 2
    err = capsys.readouterr().err
    assert "kvtier: error: --socket: expected an absolute path for a Unix socket, got ''" in err


def test_no_values_still_mean_the_defaults(monkeypatch):
    from types import SimpleNamespace

    from kvtier.bench.hops_runner import default_block_sizes
    from kvtier.cli.bench_options import check_options

    args = SimpleNamespace(repeats=None, block_sizes=None, quick=True, root_dir=None, capacities=None,
                           policies=None, workload=None, trace=None, hints="off", retain_s="auto")
    checked = check_options(args, "all")
    assert checked["block_sizes"] == default_block_sizes(True)
    assert checked["capacities"] is None and checked["policies"] is None
    args.policies = " lru , arc "
    assert check_options(args, "trace")["policies"] == ["lru", "arc"]
