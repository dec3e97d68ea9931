"""An option given an empty value is refused (exit 2, the option named), never read as "not given":
`--capacities ""`, `--policies ""` and `--block-sizes ""` ran the default sweep, `kvtier serve
--socket ""` listened on the default socket."""

from __future__ import annotations

import signal

import pytest

from kvtier.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "trace", "--capacities", ""], "--capacities: no block counts given"),
    (["bench", "--capacities", " "], "--capacities: no block counts given"),
    (["bench", "trace", "--policies", ""], "--policies: no policy given"),
    (["bench", "trace", "--policies", " , "], "--policies: no policy given"),
    (["bench", "--policies", ""], "--policies: no policy given"),
    (["bench", "hops", "--block-sizes", ""], "--block-sizes: no block size given"),
    (["bench", "--block-sizes", ""], "--block-sizes: no block size given"),
])
def test_an_empty_bench_value_is_refused_up_front(capsys, monkeypatch, argv, message):
    monkeypatch.setattr("kvtier.cli.bench.load_config", lambda path: pytest.fail("the config was read first"))
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"kvtier: error: {message}" in err and "Traceback" not in err


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
