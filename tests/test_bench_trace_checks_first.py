"""`kvtier bench` (mode all) refuses a bad --policies, --trace, a trace without the timestamps that
--hints needs, or --compare vllm without vLLM before it measures anything (before: after the hop
measurements, a minute later, with no --json written); and the check that --json / --plot can be
written leaves no empty file behind when a later check fails."""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main

MEMORY = "configs/memory.yaml"


@pytest.fixture
def no_hops(monkeypatch):
    monkeypatch.setattr("kvtier.bench.hops_runner.run_hops",
                        lambda *a, **k: pytest.fail("the hops were measured before the options were checked"))


def _no_timestamps(tmp_path):
    path = tmp_path / "nots.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": [1, 2 + i]}) + "\n" for i in range(3)))
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["--policies", "bogus"], "--policies: unknown policy 'bogus'"),
    (["--trace", "/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
    (["--trace", "NOTS", "--hints", "on"], "nots.jsonl:1: sessions need arrival times"),
])
def test_mode_all_refuses_before_measuring(tmp_path, capsys, no_hops, argv, message):
    argv = [_no_timestamps(tmp_path) if a == "NOTS" else a for a in argv]
    assert main(["bench", "--quick", "--block-sizes", "64KiB", "--config", MEMORY, *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_compare_vllm_without_vllm_is_refused_before_measuring(capsys, monkeypatch, no_hops):
    monkeypatch.setattr("kvtier.bench.replay.vllm_available", lambda: False)
    monkeypatch.setattr("kvtier.cli.bench.load_config", lambda path: pytest.fail("the config was read first"))
    assert main(["bench", "--quick", "--block-sizes", "64KiB", "--compare", "vllm", "--no-progress"]) == 2
    assert "--compare vllm needs vLLM importable" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--trace", "sample", "--policies", "bogus"],  # refused by the option checks
    ["--trace", "/no/such/trace.jsonl"],  # refused when the trace is read, after the output check
    ["--trace", "NOTS", "--hints", "on"],
])
@pytest.mark.parametrize("output", ["--json", "--plot"])
def test_a_refused_run_leaves_no_empty_output_file(tmp_path, capsys, argv, output):
    target = tmp_path / "out" / "fail.file"
    target.parent.mkdir()
    argv = [_no_timestamps(tmp_path) if a == "NOTS" else a for a in argv]
    assert main(["bench", "trace", "--config", MEMORY, *argv, output, str(target), "--no-progress"]) == 2
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_an_existing_output_file_is_left_as_it_was(tmp_path):
    target = tmp_path / "keep.json"
    target.write_text("earlier results")
    assert main(["bench", "trace", "--config", MEMORY, "--trace", "/no/such/trace.jsonl", "--json", str(target),
                 "--no-progress"]) == 2
    assert target.read_text() == "earlier results"


def test_a_good_run_still_writes_its_json(tmp_path):
    target = tmp_path / "r.json"
    assert main(["bench", "trace", "--config", MEMORY, "--quick", "--limit", "50", "--capacities", "100",
                 "--json", str(target), "--no-progress"]) == 0
    assert json.loads(target.read_text())["trace"]["requests"] == 50
