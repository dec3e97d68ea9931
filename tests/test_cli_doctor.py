"""`kvtier doctor` and `kvtier --version`: a quick "does it work here" short of the test suite.
Before, neither existed (argparse refused both)."""

from __future__ import annotations

import pytest
from remote.servers import free_port

import kvtier
from kvtier.cli.main import main


def test_doctor_passes_here_with_one_line_per_check(capsys):
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    for name in ("extensions", "kvikio", "cuda", "/dev/shm", "round trip"):
        [line] = [ln for ln in lines if f"  {name}: " in ln]
        assert line.split()[0] in ("OK", "WARN"), line
    assert "OK    round trip: 4 blocks of 32 KiB stored (cpu -> file), closed, reopened, loaded, bytes identical" in out


def test_a_round_trip_that_loses_blocks_fails(capsys, monkeypatch):
    from kvtier.standalone import KVTier

    monkeypatch.setattr(KVTier, "load", lambda self, keys, blocks: 1)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  round trip: RuntimeError: after reopening, 1 of 4 blocks were loaded" in out
    assert "1 check(s) failed" in out


def test_a_round_trip_that_brings_back_other_bytes_fails(capsys, monkeypatch):
    from kvtier.standalone import KVTier

    real_open, real_load, opened = KVTier.open, KVTier.load, []

    def open_and_keep(cls, config, kv_caches, **kwargs):
        opened.append(kv_caches)
        return real_open(config, kv_caches, **kwargs)

    def load_and_flip(self, keys, blocks):
        n = real_load(self, keys, blocks)
        opened[-1].tensors[0].tensor[2, 7] += 1  # one byte of block 2 differs
        return n

    monkeypatch.setattr(KVTier, "open", classmethod(open_and_keep))
    monkeypatch.setattr(KVTier, "load", load_and_flip)
    assert main(["doctor"]) == 1
    assert "FAIL  round trip: RuntimeError: blocks [2] came back with other bytes" in capsys.readouterr().out


def test_a_configured_valkey_tier_that_cannot_be_reached_fails(tmp_path, capsys):
    port = free_port()
    config = tmp_path / "tiers.yaml"
    config.write_text("tiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n"
                      f"  - {{name: shared, backend: valkey, capacity: 8 blocks, url: 'redis://127.0.0.1:{port}'}}\n")
    assert main(["doctor", "--config", str(config)]) == 1
    assert f"FAIL  valkey tiers[1]: url: server 127.0.0.1:{port}: connection refused" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"kvtier {kvtier.__version__}"


def test_the_round_trip_works_under_a_temporary_directory_with_quotes_and_commas(tmp_path, monkeypatch):
    """The file tier's root_dir goes into the YAML quoted: a TMPDIR holding ', or : still works."""
    import tempfile

    from kvtier.cli.doctor_roundtrip import round_trip

    odd = tmp_path / "it's, odd: #1"
    odd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(odd))
    assert round_trip().endswith("bytes identical")


def test_doctor_says_which_engine_file_path_auto_takes(capsys, monkeypatch):
    from kvtier.tiers.file import fileio

    monkeypatch.setattr(fileio, "gpu_present", lambda: True)
    monkeypatch.setattr(fileio, "gds_platform", lambda: False)
    if not fileio.kvikio_importable():
        pytest.skip("kvikio is not installed")
    main(["doctor"])
    out = capsys.readouterr().out
    assert "engine<->file under io: auto: staged (no nvidia-fs driver" in out, out
