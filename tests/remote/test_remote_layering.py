"""kvtier.remote sits below the tiers (ARCHITECTURE.md): it imports none of the control plane, the
manager, the tiers or the handlers, and `import kvtier.remote` does not load the client library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("kvtier.tiers", "kvtier.handlers", "kvtier.control", "kvtier.manager", "kvtier.engine",
             "kvtier.hierarchy", "kvtier.planes", "kvtier.integrations")


def test_remote_imports_nothing_above_it():
    package = Path(__file__).resolve().parents[2] / "kvtier" / "remote"
    offenders = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(FORBIDDEN)]
    assert offenders == []


def test_package_import_is_light():
    code = "import sys, kvtier.remote; print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
