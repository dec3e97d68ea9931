"""Each layer imports in a fresh interpreter without pulling in torch, numpy, kvikio or vllm."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "kvikio", "vllm")

LAYERS = ["kvtier", "kvtier.keys", "kvtier.types", "kvtier.errors", "kvtier.specs", "kvtier.policies",
          "kvtier.tiers.base", "kvtier.tiers.memory", "kvtier.tiers.cpu", "kvtier.tiers.file", "kvtier.handlers.base",
          "kvtier.manager", "kvtier.engine", "kvtier.config", "kvtier.hierarchy", "kvtier.cli.main",
          "kvtier.bench.replay"]


@pytest.mark.parametrize("module", LAYERS)
def test_layer_imports_light(module):
    code = (f"import sys, {module}; heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"


def test_policies_import_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import kvtier.policies.lru, kvtier.policies.arc; "
            "print(sorted(m for m in set(sys.modules) - before if not m.startswith('kvtier')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "yaml" not in out.stdout and "torch" not in out.stdout, out.stdout
