"""Hostile trace files for `kvtier bench trace`: exit status 2 and one message naming the line,
never a traceback.

Most cases call `kvtier.cli.main.main` in-process (an uncaught exception fails the test just as a
traceback would); a few run the real command line as a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.cli.main import main

GOOD = json.dumps({"timestamp": 0, "hash_ids": [1, 2, 3]}) + "\n"


def run_cli(trace_path, capsys):
    rc = main(["bench", "trace", "--trace", str(trace_path), "--no-progress", "--capacities", "8"])
    err = capsys.readouterr().err
    return rc, err


def write(tmp_path, name, data) -> str:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


CASES = {
    # name: (file content, line the message must name or None when the file as a whole is at fault)
    "empty": (b"", None),
    "blank_lines": (b"\n\n   \n\t\n", None),
    "negative_id": (GOOD + '{"hash_ids": [4, -1]}\n', 2),
    "hash_ids_not_a_list": (GOOD + GOOD + '{"hash_ids": 5}\n', 3),
    "hash_ids_string": ('{"hash_ids": "1,2,3"}\n', 1),
    "hash_ids_null": ('{"hash_ids": null}\n', 1),
    "hash_ids_missing": ('{"input_length": 12}\n', 1),
    "top_level_list": ("[1, 2, 3]\n", 1),
    "float_ids": ('{"hash_ids": [1.5]}\n', 1),
    "bool_ids": ('{"hash_ids": [true]}\n', 1),
    "nan": ('{"hash_ids": [NaN]}\n', 1),
    "infinity": ('{"hash_ids": [1e400]}\n', 1),
    "nested_list": ('{"hash_ids": [[1]]}\n', 1),
    "truncated_json": (GOOD + '{"hash_ids": [1, 2\n', 2),
    "utf8_bom": ("\ufeff" + GOOD, 1),
    "ten_mb_single_line": ("x" * (10 << 20) + "\n", 1),
}

# Found by the hostile-input campaign (docs/reliability.md, bug 4) and fixed in kvtier/bench/replay.py.
BUG_CASES = {
    "binary_garbage": (bytes(range(256)) * 64, 1),
    "invalid_utf8_on_line_3": (GOOD.encode() * 2 + b'{"hash_ids": [1]}\xff\xfe\n', 3),
    "id_above_64_bits": (GOOD + '{"hash_ids": [18446744073709551616]}\n', 2),
    "id_with_5000_digits": ('{"hash_ids": [' + "9" * 5000 + "]}\n", 1),
    "deeply_nested": ("[" * 100_000 + "]" * 100_000 + "\n", 1),
}


def check(rc, err, path, line):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one message, got: {err[:500]}"
    assert lines[0].startswith("kvtier: error: ")
    assert path in lines[0]
    where = f"{path}:{line}:" if line is not None else f"{path}:"
    assert where in lines[0], lines[0][:300]
    assert lines[0].split(where, 1)[1].strip(), f"the message gives no reason: {lines[0][:300]}"
    assert len(lines[0]) < 1000, "the message repeats the hostile input"


@pytest.mark.parametrize("case", sorted(CASES) + sorted(BUG_CASES))
def test_hostile_trace_is_refused_with_one_message(tmp_path, capsys, case):
    content, line = {**CASES, **BUG_CASES}[case]
    path = write(tmp_path, case + ".jsonl", content)
    rc, err = run_cli(path, capsys)
    check(rc, err, path, line)


def test_missing_and_directory_traces(tmp_path, capsys):
    for path in (str(tmp_path / "nope.jsonl"), str(tmp_path)):
        rc, err = run_cli(path, capsys)
        assert rc == 2 and "Traceback" not in err and path in err


@pytest.mark.parametrize("content,line", [(b"\x00\x01garbage\n", 1), (GOOD + '{"hash_ids": {"a": 1}}\n', 2)])
def test_hostile_trace_through_the_real_command(tmp_path, content, line):
    path = write(tmp_path, "t.jsonl", content)
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "trace", "--trace", path,
                           "--no-progress", "--capacities", "8"], capture_output=True, text=True, timeout=120)
    check(proc.returncode, proc.stderr, path, line)
    assert proc.stdout == "", f"a refused trace printed results: {proc.stdout[:300]}"


def test_valid_trace_still_replays(tmp_path, capsys):
    path = write(tmp_path, "ok.jsonl", GOOD * 3 + "\n" + json.dumps({"hash_ids": [1, 2, 4]}) + "\n")
    rc = main(["bench", "trace", "--trace", path, "--no-progress", "--capacities", "8"])
    assert rc == 0
