"""The shared tier's client sits below its backend (ARCHITECTURE.md): the client's modules import none
of the control plane, the manager, the other tiers, the handlers or the backend's own modules, and
`import kvtier.tiers.remote` does not load the client library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvtier" / "tiers" / "remote"
CLIENT = ("breaker", "errors", "guard", "keys", "nodes", "options", "password", "store", "topology", "url",
          "value_format", "bench")
ABOVE = ("kvtier.tiers.base", "kvtier.tiers.cpu", "kvtier.tiers.file", "kvtier.tiers.memory",
         "kvtier.transfer.handlers", "kvtier.control", "kvtier.control.manager", "kvtier.transfer.router",
         "kvtier.control.hierarchy", "kvtier.transfer.planes", "kvtier.integrations", "kvtier.tiers.remote.backend",
         "kvtier.tiers.remote.handler", "kvtier.tiers.remote.probes", "kvtier.tiers.remote.runtime",
         "kvtier.tiers.remote.env")


def test_the_client_imports_nothing_above_it():
    offenders = []
    for name in CLIENT:
        path = PACKAGE / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(ABOVE)]
    assert offenders == []


def test_package_import_is_light():
    code = ("import sys, kvtier.tiers.remote, kvtier.tiers.remote.options; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
