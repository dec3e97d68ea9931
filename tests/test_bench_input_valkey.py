"""`kvtier bench hops` with a valkey tier whose server cannot be used: a clear error naming the tier
and the server (as `kvtier doctor --config` reports it), exit 2, within the tier's timeout, and the
rows measured before the server failed still printed."""

from __future__ import annotations

import time

import pytest

from kvtier.cli.main import main
from kvtier.tiers.remote.backend import ValkeyBackend

pytest.importorskip("redis")

CONFIG = """\
tiers:
  - {name: cpu, backend: cpu, capacity: 64MiB}
  - {name: shared, backend: valkey, capacity: 1000 blocks, url: "redis://127.0.0.1:1", timeout_ms: 100}
"""


def _argv(tmp_path) -> list[str]:
    config = tmp_path / "valk3.yaml"
    config.write_text(CONFIG)
    return ["bench", "hops", "--config", str(config), "--block-sizes", "64KiB", "--repeats", "1", "--quick",
            "--root-dir", str(tmp_path), "--no-progress"]


def test_an_unreachable_server_is_named_before_anything_is_measured(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvtier.bench.hops.measure_gpu_cpu", lambda *a, **k: pytest.fail("measured first"))
    monkeypatch.setattr("kvtier.bench.file_hops.measure_cpu_file", lambda *a, **k: pytest.fail("measured first"))
    start = time.monotonic()
    assert main(_argv(tmp_path)) == 2
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert "kvtier: error: valkey tier 'shared' cannot be measured: url: server 127.0.0.1:1: connection " \
           "refused" in err
    assert "Traceback" not in err


def test_a_server_lost_mid_run_keeps_the_rows_measured_before(tmp_path, capsys, monkeypatch):
    real = ValkeyBackend.check_environment.__func__  # type: ignore[attr-defined]
    answers = iter([([], [])])  # the first check passes: the server goes away after it

    def check(cls, options):
        return next(answers, None) or real(cls, options)

    monkeypatch.setattr(ValkeyBackend, "check_environment", classmethod(check))
    monkeypatch.setattr("kvtier.bench.hops_runner.engine_device", lambda: "none")  # the file hops suffice
    assert main(_argv(tmp_path)) == 2
    captured = capsys.readouterr()
    assert "measured before the valkey tier failed:" in captured.out
    assert any(line.startswith("CPU->FILE") for line in captured.out.splitlines())
    assert "kvtier: error: valkey tier 'shared' cannot be measured: url: server 127.0.0.1:1" in captured.err
    assert "Traceback" not in captured.err
    assert [p.name for p in tmp_path.iterdir()] == ["valk3.yaml"]  # the file hops' directory is removed


def test_a_failed_measurement_on_a_server_that_answers_names_tier_and_server(monkeypatch):
    from kvtier.bench import remote_hops
    from kvtier.config import load_config_text

    options = dict(load_config_text(CONFIG).tiers[1].options)
    monkeypatch.setattr(remote_hops, "check_reachable", lambda name, options: None)  # as if it answered PING
    with pytest.raises(remote_hops.RemoteUnavailable, match=r"^valkey tier 'shared' \(server 127\.0\.0\.1:1\): "
                                                            r"measuring 65536-byte blocks failed \(ConnectionError"):
        remote_hops.measure_tier("shared", options, 64 << 10, 1 << 20)
