"""docs/bench.md and the README say what the trace replay does: every key a session replay writes
under `trace` is in the JSON schema table (`ends_known` of `trace.optimum[]` and of
`trace.sessions.by_capacity[]` were missing), one-time requests are documented as hinted (they
carry a `session_ended` hint: `SessionHints` defaults to `one_shot=True`; the docs said "none"), and
the README no longer says `timestamp` and `input_length` are ignored (with --hints they are read)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvtier.bench.sessions import SessionHints, SessionTrace
from kvtier.cli.main import main
from kvtier.control.hints import HINTS_KEY

ROOT = Path(__file__).resolve().parents[1]
BENCH_MD = ROOT / "docs" / "bench.md"
README = ROOT / "README.md"


def _schema_row(key: str) -> str:
    row = next((line for line in BENCH_MD.read_text().splitlines() if line.startswith(f"| `{key}` |")), None)
    assert row is not None, f"docs/bench.md has no schema row for {key}"
    return row


@pytest.fixture
def doc(tmp_path, vllm_stand_in):
    """A session replay with hints both and a stand-in for vLLM's manager (one LRU tier), over two tiers."""
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--config", "configs/memory.yaml", "--workload", "chat", "--quick", "--limit",
                 "200", "--hints", "both", "--capacities", "100", "--compare", "vllm", "--json", str(out),
                 "--no-progress"]) == 0
    return json.loads(out.read_text())["trace"]


def test_every_trace_key_is_in_the_schema_table(doc):
    missing = []
    for table, rows in (("trace", [doc]), ("trace.optimum[]", doc["optimum"]), ("trace.runs[]", doc["runs"]),
                        ("trace.sessions", [doc["sessions"]] + doc["sessions"]["by_capacity"])):
        text = _schema_row(table)
        missing += [f"{table}: {key}" for row in rows for key in row
                    if f"`{key}`" not in text and f"`{key}[]`" not in text]
    assert not missing, f"docs/bench.md's schema table lacks: {sorted(set(missing))}"
    assert "ends_known" in doc["optimum"][0] and "ends_known" in doc["sessions"]["by_capacity"][0]


def test_one_time_requests_are_documented_as_hinted():
    trace = SessionTrace("t", [[1], [2]], arrivals=[0.0, 1.0], sessions=["a", None], tenants=["", ""],
                         last_turn=[True, False])
    hint = SessionHints(trace, 10).context("1").kv_transfer_params[HINTS_KEY]
    assert hint["session_ended"] is True  # a one-time request: a session ended at its first turn
    text = " ".join(BENCH_MD.read_text().split())
    assert "one-time requests carry none" not in text
    assert "a one-time request is hinted as a session ended at its first turn" in text


def test_the_readme_says_when_timestamps_are_read():
    text = " ".join(README.read_text().split())
    paragraph = re.search(r"kvtier reads JSONL:.*?line number\.", text).group(0)
    assert "(`timestamp`, `input_length`, `output_length`) are ignored" not in paragraph
    assert "with `--hints on|both` each line needs a `timestamp`" in paragraph and "`input_length`" in paragraph
