"""Every module of kvtier and of the checkout's benchmarks/ that runs as `python -m` parses its
arguments: `--help` prints usage and exits 0, measuring nothing and creating nothing in the working
directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "kvtier", ROOT / "benchmarks")


def _main_modules() -> list[str]:
    """Every module with an `if __name__ == "__main__":` block or a `__main__.py`, found in the source."""
    names = []
    for path in sorted(p for package in PACKAGES for p in package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name == "__main__.py" or 'if __name__ == "__main__"' in text or "if __name__ == '__main__'" in text:
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return names


def test_the_modules_with_a_main_are_found():
    assert {"kvtier.bench.file_hops", "kvtier.tiers.file.checksum", "kvtier.cli.main", "benchmarks.cycle"} <= set(
        _main_modules())


@pytest.mark.parametrize("module", _main_modules())
def test_help_prints_usage_and_runs_nothing(tmp_path, module):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:"), out.stdout[:500]
    assert list(tmp_path.iterdir()) == []  # no './--help' directory, no output files
