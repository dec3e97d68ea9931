"""The README's configuration example is a valid hierarchy (docs match the code)."""

import re
from pathlib import Path

from kvtier import load_config_text

README = Path(__file__).resolve().parents[1] / "README.md"


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


def test_readme_lists_every_policy_clause():
    """The README's list of what a third-party policy must meet is the suite's own list."""
    from kvtier.testing.policy_contract import POLICY_CLAUSES

    text = " ".join(README.read_text().split())  # the README wraps lines
    missing = [clause for clause in POLICY_CLAUSES if " ".join(clause.split()) not in text]
    assert not missing, f"README.md does not list these PolicyTests clauses: {missing}"
