"""The `kvtier` command: exit codes, JSON schema, clear errors without tracebacks."""

import json
import os
import subprocess
import sys

import pytest

from kvtier.bench import provenance
from kvtier.cli.main import BENCH_MODES, BENCH_OPTIONS, main

MEMORY = "configs/memory.yaml"


def run(*args):
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], capture_output=True, text=True, timeout=300)


def test_config_check_prints_the_resolved_hierarchy(capsys):
    assert main(["config", "check", MEMORY]) == 0
    out = capsys.readouterr().out
    assert "[0] hot: backend=memory" in out and "1024 blocks" in out and "cascade on_evict to warm" in out


def test_config_check_lists_errors_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {name: cpu, backend: memory, capacity: 64GB}\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "tiers[0].capacity" in capsys.readouterr().err


def test_bench_trace_writes_the_documented_json(tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--config", MEMORY, "--quick", "--capacities", "100,400", "--policies", "lru,arc",
                 "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kvtier.bench/2"
    assert {"machine", "versions", "config", "trace", "summary", "created", "commit"} <= set(doc)
    assert doc["commit"] == provenance.commit() and doc["machine"]["cpus"] == os.cpu_count()
    runs = doc["trace"]["runs"]
    assert [(r["policy"], r["capacity_blocks"]) for r in runs] == [
        ("lru", 100), ("arc", 100), ("lru", 400), ("arc", 400)]
    for r in runs:
        assert 0 <= r["hit_rate"] <= doc["trace"]["optimum_hit_rate"] + 1e-9 and r["block_ops_per_s"] > 0
        assert set(r["tiers"]) == {"hot", "warm"}
    # The offline optimum for the whole hierarchy (warm tier: 4096 blocks) bounds every run at its size.
    ceilings = {o["capacity_blocks"]: o for o in doc["trace"]["optimum"]}
    assert [(c, o["total_capacity_blocks"]) for c, o in sorted(ceilings.items())] == [(100, 4196), (400, 4496)]
    for r in runs:
        assert r["hit_rate"] <= ceilings[r["capacity_blocks"]]["hit_rate"] + 1e-9
    assert ceilings[100]["hit_rate"] <= ceilings[400]["hit_rate"] <= doc["trace"]["optimum_hit_rate"] + 1e-9


def test_bench_trace_replays_a_mooncake_file(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i, "hash_ids": [1, 2, 3 + i]}) for i in range(20)) + "\n")
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--config", MEMORY, "--trace", str(trace), "--json", str(out), "--no-progress"]) == 0
    run_ = json.loads(out.read_text())["trace"]["runs"][0]
    assert run_["blocks"] == 60 and run_["hit_blocks"] == 38  # blocks 1 and 2 hit in 19 requests


@pytest.mark.parametrize("args, message", [
    (["bench", "trace", "--trace", "/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
    (["bench", "trace", "--trace", "BAD"], "BAD_PATH:2: not valid JSON"),
    (["bench", "trace", "--trace", "NOHASH"], "NOHASH_PATH:1: expected an object with 'hash_ids'"),
    (["bench", "trace", "--json", "/no/such/dir/out.json"], "cannot write JSON output"),
    (["bench", "trace", "--capacities", "10k,lots"], "--capacities: 'lots' is not a block count"),
    (["bench", "trace", "--policies", "lru,nope"], "unknown policy 'nope'"),
    (["bench", "trace", "--policies", "lru,os:_exit"], "--policies: policy 'os:_exit' names a function, not a class"),
    (["bench", "--config", "/no/such.yaml"], "cannot read config /no/such.yaml"),
])
def test_user_mistakes_give_one_message_and_exit_2(tmp_path, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1]}\n{broken\n')
    nohash = tmp_path / "nohash.jsonl"
    nohash.write_text('{"input_length": 3}\n')
    args = [str(bad) if a == "BAD" else str(nohash) if a == "NOHASH" else a for a in args]
    if "--config" not in args:
        args += ["--config", MEMORY]
    result = run(*args, "--no-progress")
    message = message.replace("BAD_PATH", str(bad)).replace("NOHASH_PATH", str(nohash))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------------
# Every option takes effect wherever it is written: on `bench` before the sub-command, or after it.
# ------------------------------------------------------------------------------------------------

# A value different from the default for each bench option (flags, value argv, expected attribute).
OPTION_VALUES = {
    "--config": (["X.yaml"], "X.yaml"), "--json": (["o.json"], "o.json"), "--plot": (["p.png"], "p.png"),
    "--quick": ([], True), "--no-progress": ([], True), "--block-sizes": (["1MiB"], "1MiB"),
    "--root-dir": (["/r"], "/r"), "--trace": (["t.jsonl"], "t.jsonl"), "--limit": (["7"], 7),
    "--capacities": (["1k"], "1k"), "--policies": (["arc"], "arc"), "--compare": (["vllm"], "vllm"),
    "--repeats": (["3"], 3), "--workload": (["agentic"], "agentic"), "--hints": (["both"], "both"),
    "--retain-s": (["30"], "30"),
}


def _bench_cases():
    for mode in (None, "all", "hops", "trace"):
        for flags, _, applies in BENCH_OPTIONS:
            if not applies & BENCH_MODES[mode or "all"]:
                continue
            for where in ("before", "after") if mode else ("before",):
                yield mode, flags[0], where


@pytest.fixture
def captured_bench(monkeypatch):
    seen = []
    monkeypatch.setattr("kvtier.cli.bench.run_bench", lambda args: seen.append(args) or 0)
    return seen


def test_every_bench_option_is_tested():
    assert {flags[0] for flags, _, _ in BENCH_OPTIONS} == set(OPTION_VALUES)


@pytest.mark.parametrize("mode, option, where", list(_bench_cases()))
def test_bench_option_takes_effect_before_or_after_the_subcommand(captured_bench, mode, option, where):
    values, expected = OPTION_VALUES[option]
    sub = [mode] if mode else []
    argv = ["bench", option, *values, *sub] if where == "before" else ["bench", *sub, option, *values]
    assert main(argv) == 0
    [args] = captured_bench
    dest = option.lstrip("-").replace("-", "_")
    assert getattr(args, dest) == expected
    for flags, kwargs, _ in BENCH_OPTIONS:  # every other option has its default
        if flags[0] != option:
            assert getattr(args, flags[0].lstrip("-").replace("-", "_")) == kwargs["default"], flags[0]


@pytest.mark.parametrize("argv", [
    ["bench", "--quick", "--limit", "5", "trace", "--limit", "9"],
    ["bench", "--limit", "9", "trace", "--quick"],
])
def test_bench_options_on_both_sides_combine_and_the_later_wins(captured_bench, argv):
    assert main(argv) == 0
    [args] = captured_bench
    assert (args.quick, args.limit, args.bench_command) == ("--quick" in argv, 9, "trace")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--trace", "t.jsonl", "hops"], "--trace has no effect on 'bench hops'; it applies to: bench all, trace"),
    (["bench", "--block-sizes", "1MiB", "trace"], "--block-sizes has no effect on 'bench trace'"),
])
def test_bench_option_before_a_subcommand_it_does_not_apply_to_is_refused(captured_bench, capsys, argv, message):
    assert main(argv) == 2 and not captured_bench
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "trace", "--limit", "0"], ["bench", "--repeats", "-1", "trace"],
                                  ["bench", "hops", "--trace", "t.jsonl"], ["bench", "trace", "--limit", "many"]])
def test_bench_option_values_and_places_argparse_refuses(captured_bench, capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and not captured_bench and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["bench", "--config", "/no/such/X.yaml"],
    *[["bench", "--config", "/no/such/X.yaml", sub] for sub in ("all", "hops", "trace")],
    *[["bench", sub, "--config", "/no/such/X.yaml"] for sub in ("all", "hops", "trace")],
])
def test_bench_reads_the_config_given_anywhere(capsys, argv):
    """End to end: the --config given is the one read (it does not exist: exit 2 naming it)."""
    assert main([*argv, "--no-progress"]) == 2
    assert "cannot read config /no/such/X.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["bench", "--quick", "trace", "--config", MEMORY],
    ["bench", "trace", "--quick", "--config", MEMORY],
])
def test_bench_quick_takes_effect_on_trace_wherever_written(tmp_path, argv):
    out = tmp_path / "r.json"
    assert main([*argv, "--capacities", "50", "--policies", "lru", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    from kvtier.bench import workloads

    assert doc["trace"]["requests"] == len(workloads.generate_trace(num_conversations=60).requests)


@pytest.mark.parametrize("argv", [
    ["config", "check", "--block-bytes", "2MiB", MEMORY],
    ["config", "check", MEMORY, "--block-bytes", "2MiB"],
])
def test_config_check_options_take_effect_wherever_written(capsys, argv):
    assert main(argv) == 0
    assert "2MiB per block" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["before", "after"])
def test_config_check_import_code_takes_effect_wherever_written(tmp_path, capsys, where):
    config = tmp_path / "c.yaml"
    config.write_text("tiers:\n  - {name: hot, backend: memory, capacity: 8 blocks, policy: 'os:_exit'}\n")
    argv = ["config", "check", "--import-code", str(config)] if where == "before" else \
        ["config", "check", str(config), "--import-code"]
    assert main(argv) == 2
    assert "tiers[0].policy: policy 'os:_exit' names a function, not a class" in capsys.readouterr().err


def test_config_check_help_says_a_config_is_trusted_like_code(capsys):
    with pytest.raises(SystemExit):
        main(["config", "check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "A config is trusted input, like code" in text and "--import-code" in text


@pytest.mark.parametrize("argv", [
    ["inspect", "--verify", "--json", "OUT", "ROOT"],
    ["inspect", "ROOT", "--verify", "--json", "OUT"],
    ["inspect", "--json", "OUT", "ROOT", "--verify"],
])
def test_inspect_options_take_effect_wherever_written(tmp_path, capsys, argv):
    from kvtier import build_hierarchy, load_config_text

    root = tmp_path / "root"
    build_hierarchy(load_config_text("block_bytes: 4KiB\ntiers:\n  - {name: hot, backend: memory, capacity: 4 blocks}\n"
                                     f"  - {{name: disk, backend: file, capacity: 4 blocks, root_dir: {root}}}\n"),
                    model="test-model").close()
    out = tmp_path / "report.json"
    argv = [str(root) if a == "ROOT" else str(out) if a == "OUT" else a for a in argv]
    assert main(argv) == 0
    assert "verified_ok" in json.loads(out.read_text())  # written by --json, present only with --verify


@pytest.mark.parametrize("command", [["doctor"], ["bench", "trace"]])
def test_a_bad_config_names_its_file_and_lists_each_problem(tmp_path, capsys, command):
    """Before: `bench`/`doctor --config` printed the problems without the file, the second one
    not indented (as `kvtier config check` lists them now)."""
    path = tmp_path / "bad.yaml"
    path.write_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 0, polcy: x}\n")
    assert main([*command, "--config", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"kvtier: error: {path}: 2 problem(s):"
    assert err[1].startswith("  tiers[0].polcy: unknown key") and err[2].startswith("  tiers[0].capacity:")
