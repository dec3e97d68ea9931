"""The README's configuration example is a valid hierarchy (docs match the code)."""

import fnmatch
import re
from pathlib import Path

from kvtier import load_config_text

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_config_example_loads():
    text = re.search(r"## Configuration\n\n```yaml\n(.*?)```", README.read_text(), re.S).group(1)
    config = load_config_text(text, "README.md")
    assert [t.backend for t in config.tiers] == ["cpu", "file"]
    assert config.tiers[0].options["pin"] == "auto" and config.tiers[1].options["num_threads"] == 4


STANDALONE = README.parent / "docs" / "standalone.md"


def test_standalone_worked_example_runs():
    """docs/standalone.md's worked example is code that runs: its page and block sizes are what
    kvtier computes (KVLayout), not arithmetic typed by hand."""
    section = STANDALONE.read_text().split("## Worked example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(STANDALONE), "exec"), namespace)
    assert namespace["layout"].block_bytes == 32 << 20


def test_readme_lists_every_suite_clause():
    """The README's lists of what a third-party policy or backend must meet are the suites' own."""
    from kvtier.testing.backend_contract import BACKEND_CLAUSES
    from kvtier.testing.policy_contract import POLICY_CLAUSES

    text = " ".join(README.read_text().split())  # the README wraps lines
    missing = [clause for clause in (*POLICY_CLAUSES, *BACKEND_CLAUSES) if " ".join(clause.split()) not in text]
    assert not missing, f"README.md does not list these conformance clauses: {missing}"


RESULTS = README.parent / "docs" / "results"


def _which_policy_rows() -> dict[str, list[str]]:
    """README "Which policy when" rows: policy name -> cells (hit rates, CPU µs, bytes)."""
    section = README.read_text().split("## Which policy when", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.fullmatch(r"`([a-z-]+)`", cells[0])
        if line.startswith("|") and name:
            rows[name.group(1)] = cells
    return rows


def test_which_policy_table_matches_its_results():
    """Every figure of the README's policy table is the one in the JSON the README names."""
    import json

    trace = json.loads((RESULTS / "trace-conversation-policies-2026-11-27.json").read_text())["trace"]["runs"]
    cycle = json.loads((RESULTS / "cycle-cpu-2026-11-27.json").read_text())["rows"]
    memory = json.loads((RESULTS / "memory-2026-11-27.json").read_text())["rows"]
    rows = _which_policy_rows()
    assert set(rows) == {"prefix-freq", "lru", "arc", "sieve"}
    for policy, cells in rows.items():
        rates = [f"{r['hit_rate']:.4f}" for cap in (2000, 10000, 40000) for r in trace
                 if (r["system"], r["policy"], r["capacity_blocks"]) == ("kvtier", policy, cap)]
        assert cells[2].replace("*", "") == " / ".join(rates), policy
        cpu = next(r["cpu_us_per_block"] for r in cycle if (r["workload"], r["system"]) == ("conversation", policy))
        assert cells[3].replace("*", "") == f"{cpu:.2f}", policy
        per_block = next(r["bytes_per_block"] for r in memory if r["policy"] == policy)
        assert cells[4].replace("*", "").split()[0] == f"{per_block:.0f}", policy


def test_docs_name_no_path_of_one_machine():
    """Commands in the docs run anywhere: no path into this project's own machines (the traces
    live wherever the reader put them: `TRACES`, `DIR`)."""
    docs = [README, *sorted((README.parent / "docs").glob("*.md"))]
    found = [f"{path.name}:{n}: {line.strip()}" for path in docs
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"(?<![\w.~])/(work|home|root|Users)/", line)]
    assert not found, "\n".join(found)


def test_policies_hit_rate_table_matches_its_results():
    """docs/policies.md's hit rates are those of the JSON it names, for kvtier's and vLLM's rows."""
    import json

    text = (README.parent / "docs" / "policies.md").read_text()
    table = text.split("## Hit rates", 1)[1].split("\n## ", 1)[0]
    checked = 0
    for line in table.splitlines():
        cells = [c.strip().replace("*", "") for c in line.strip("|").split("|")]
        if len(cells) != 5 or cells[0] not in ("conversation", "synthetic"):
            continue
        trace = json.loads((RESULTS / f"trace-{cells[0]}-policies-2026-11-27.json").read_text())["trace"]
        system, _, policy = cells[1].rpartition(" ")
        for cap, cell in zip((2000, 10000, 40000), cells[2:]):
            if system == "offline":  # offline Belady
                got = next(o["hit_rate"] for o in trace["optimum"] if o["capacity_blocks"] == cap)
            else:
                got = next(r["hit_rate"] for r in trace["runs"] if (r["system"], r["policy"], r["capacity_blocks"])
                           == (system or "kvtier", policy, cap))
            assert cell == f"{got:.4f}", (cells[0], cells[1], cap)
            checked += 1
    assert checked == 2 * 7 * 3


def test_the_readme_says_what_setup_sh_installs_outside_the_checkout():
    """Issue 36.10: scripts/setup.sh adds an apt source and installs valkey-server as root; the
    README said nothing of it. Each system-wide change the script can make is named there."""
    script = (README.parent / "scripts" / "setup.sh").read_text()
    section = " ".join(README.read_text().split("## The two commands", 1)[1].split("\n## ", 1)[0].split())
    for thing in ("apt-get", "valkey-server", "valkey-tools", "redis-server", "bookworm-backports",
                  "/etc/apt/sources.list.d/bookworm-backports.list"):
        assert thing in script, f"setup.sh no longer mentions {thing}: update this test and the README"
        assert thing in section, f"README's 'The two commands' does not say setup.sh may touch {thing}"
    assert '"$(id -u)" = 0' in script and "as root" in section


def _names_cited(text: str) -> set[str]:
    """JSON file names `text` cites, with `{a,b}` alternatives expanded (`*` patterns kept, the
    bare `*.json` left out: it names no file in particular)."""
    def expand(name: str) -> list[str]:
        m = re.search(r"\{([^{}]*)\}", name)
        if not m:
            return [name]
        return [x for alt in m.group(1).split(",") for x in expand(name[:m.start()] + alt + name[m.end():])]
    return {x for m in re.finditer(r"[A-Za-z0-9_.{},*\-]+\.json", text) if m.group(0) != "*.json"
            for x in expand(m.group(0))}


def test_every_results_file_is_cited_by_a_doc():
    """`docs/results/` keeps only measurements a doc cites (by name, `{a,b}` alternatives or a
    pattern such as `*-h200-2026-11-28.json`): an uncited file is a figure nobody can find."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    cited = set().union(*(_names_cited(p.read_text()) for p in docs))
    results = sorted(p.name for p in (ROOT / "docs" / "results").iterdir())
    uncited = [name for name in results if not any(fnmatch.fnmatch(name, pattern) for pattern in cited)]
    assert results and uncited == []
