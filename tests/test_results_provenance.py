"""Every file in docs/results/ says when, on which code and on which machine it was measured
(docs/bench.md, "JSON schema"), and the generators of those files write it.

A benchmark writes `kvtier.bench.provenance.provenance()` at the top level (`created`, `commit`,
`machine`); older files carry what was recovered afterwards in a top-level `provenance` object
(`commit` where a doc or commit message names the measured code, else `commit_added`, the commit
that added the file; `committed`, that commit's date, where the file has no date; `machine` in the
citing doc's words, or "unrecorded"; `provenance_note` says how).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
FILES = sorted(RESULTS.glob("*.json"))
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
COMMIT = re.compile(r"^[0-9a-f]{7,40}(\+dirty)?$")


def facts(doc: dict[str, Any]) -> dict[str, Any]:
    """The file's date, commit and machine: top-level keys, else the recovered `provenance` object."""
    recovered = doc.get("provenance") if isinstance(doc.get("provenance"), dict) else {}
    return {"date": doc.get("created") or doc.get("date") or recovered.get("created") or recovered.get("committed"),
            "commit": doc.get("commit") or recovered.get("commit") or recovered.get("commit_added"),
            "machine": doc.get("machine") or recovered.get("machine")}


def test_there_are_results():
    assert len(FILES) > 10


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_a_results_file_has_a_date_a_commit_and_a_machine(path):
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict), f"{path.name}: not a JSON object"
    got = facts(doc)
    assert isinstance(got["date"], str) and DATE.match(got["date"]), f"{path.name}: no date ({got['date']!r})"
    assert isinstance(got["commit"], str) and COMMIT.match(got["commit"]), f"{path.name}: no commit ({got['commit']!r})"
    assert got["machine"], f"{path.name}: no machine"
    if "provenance" in doc:
        assert doc["provenance"].get("provenance_note"), f"{path.name}: recovered provenance without its note"


def test_the_recovered_commits_exist():
    """Each commit a results file names is one of this repository's (outside a git checkout: skipped)."""
    named = {}
    for path in FILES:
        doc = json.loads(path.read_text())
        recovered = doc.get("provenance") or {}
        for key in ("commit", "commit_added", "commit_last_changed"):
            for value in (recovered.get(key), doc.get(key)):
                if isinstance(value, str) and COMMIT.match(value):
                    named[value.removesuffix("+dirty")] = path.name
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"], input="\n".join(named) + "\n",
                             capture_output=True, text=True, timeout=60)
    except OSError:
        pytest.skip("no git")
    if out.returncode != 0 or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    missing = [line for line in out.stdout.splitlines() if line.endswith(" missing")]
    assert missing == [], [(line.split()[0], named.get(line.split()[0])) for line in missing]


# ---------------------------------------------------------------- the generators
def _load(rel: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # (a script may add its own directories)
    name = "_provenance_" + Path(rel).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _has_provenance(doc: dict[str, Any]) -> None:
    for key in ("created", "commit", "machine", "versions"):
        assert key in doc, f"no {key!r} in {sorted(doc)}"
    assert DATE.match(doc["created"]) and isinstance(doc["machine"], dict)


def test_host_share_writes_provenance(monkeypatch):
    host_share = _load("benchmarks/host_share.py", monkeypatch)
    doc = host_share.result_doc([{"engines": 1, "rows": []}])
    _has_provenance(doc)
    assert doc["benchmark"] == "host_share" and doc["results"] == [{"engines": 1, "rows": []}]
    assert "result_doc(" in ast.get_source_segment(Path(host_share.__file__).read_text(),
                                                   _function(host_share.__file__, "main"))


def test_trace_vllm_reload_writes_provenance(monkeypatch):
    import argparse

    trace = _load("scripts/trace_vllm_reload.py", monkeypatch)
    args = argparse.Namespace(backend="kvtier", connector="kvtier", direct_file_loads="on")
    doc = trace.result_doc(args, [{"name": "file:A:0"}], {"file": {"total_s": 1.0}})
    _has_provenance(doc)
    assert doc["rows"] == [{"name": "file:A:0"}] and doc["connector"] == "kvtier"
    assert "result_doc(" in ast.get_source_segment(Path(trace.__file__).read_text(),
                                                   _function(trace.__file__, "main"))


def _function(path: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(Path(path).read_text())
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name)


def test_every_benchmark_that_writes_json_writes_provenance():
    """docs/bench.md: every benchmark here writes `provenance()` into its JSON. A module of
    benchmarks/ or scripts/ that dumps JSON names `provenance` (a cheap check: the two above run it)."""
    dumping = [p for d in ("benchmarks", "scripts") for p in sorted((ROOT / d).rglob("*.py"))
               if re.search(r"json\.dumps?\(", p.read_text())]
    assert dumping
    without = [str(p.relative_to(ROOT)) for p in dumping if "provenance" not in p.read_text()]
    assert without == [], f"these write JSON without kvtier.bench.provenance.provenance(): {without}"
