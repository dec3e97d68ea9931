"""Backends depend on no config module (issue 28): each backend package, imported in a fresh
interpreter without running `kvtier/__init__.py` (which loads the config layer for users), loads
neither `kvtier.config` nor `kvtier.config.input`, with every module of the package imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TIERS = Path(__file__).resolve().parents[2] / "kvtier" / "tiers"
CONFIG = ("kvtier.config", "kvtier.config.input")


def _modules_of(package: str) -> list[str]:
    folder = TIERS / package.rsplit(".", 1)[1]
    if not folder.is_dir():
        return [package]
    return [package] + [f"{package}.{p.stem}" for p in sorted(folder.glob("*.py")) if p.stem != "__init__"]


@pytest.mark.parametrize("package", ["kvtier.tiers.file", "kvtier.tiers.cpu", "kvtier.tiers.remote",
                                     "kvtier.tiers.memory"])
def test_a_backend_package_imports_no_config_module(package):
    code = ("import importlib, importlib.util, sys\n"
            "spec = importlib.util.find_spec('kvtier')\n"
            "sys.modules['kvtier'] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run\n"
            f"for name in {_modules_of(package)!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m in {CONFIG!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{package} imported {out.stdout.strip()}"
