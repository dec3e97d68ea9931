"""Each layer imports in a fresh interpreter without pulling in torch, numpy, kvikio or vllm."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "numpy", "kvikio", "vllm")

# One entry per layer, lowest first (ARCHITECTURE.md, "Which way imports go"); every module of the
# package is checked too, by test_every_module_imports_light. `kvtier.integrations.vllm` is left
# out: it is the one place that imports vLLM.
LAYERS = ["kvtier", "kvtier.core.keys", "kvtier.core.types", "kvtier.core.errors", "kvtier.core.limits",
          "kvtier.core.specs", "kvtier.policies", "kvtier.tiers", "kvtier.tiers.base", "kvtier.tiers.memory",
          "kvtier.tiers.cpu", "kvtier.tiers.file", "kvtier.tiers.file.inspection", "kvtier.transfer.handlers",
          "kvtier.transfer.handlers.base", "kvtier.transfer.handlers.memory", "kvtier.transfer.handlers.cpu_file",
          "kvtier.transfer.handlers.gpu_cpu", "kvtier.transfer.handlers.gpu_file", "kvtier.transfer.registry",
          "kvtier.control", "kvtier.control.manager", "kvtier.transfer.router", "kvtier.transfer.planes",
          "kvtier.config.input", "kvtier.config", "kvtier.tiers.room", "kvtier.control.hierarchy",
          "kvtier.standalone", "kvtier.testing", "kvtier.integrations", "kvtier.cli.main", "kvtier.bench.replay"]


@pytest.mark.parametrize("module", LAYERS)
def test_layer_imports_light(module):
    code = (f"import sys, {module}; heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"


def _package_modules() -> list[str]:
    """Every module of the kvtier package but the vLLM integration, from the source tree."""
    package = Path(__file__).resolve().parents[1] / "kvtier"
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts[:3] != ("kvtier", "integrations", "vllm"):
            names.append(".".join(parts))
    return names


def test_every_module_imports_light():
    """Each module, imported in turn in one fresh interpreter, brings nothing heavy (the first one
    that does is named: nothing heavy came before it)."""
    modules = _package_modules()
    assert {"kvtier.control.cascade", "kvtier.tiers.file.slab", "kvtier.transfer.handlers.rows",
            "kvtier.testing.policy", "kvtier.cli.inspect"} <= set(modules)
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"    heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
            "    if heavy:\n"
            "        print(name, 'imported', ','.join(heavy[:5]))\n"
            "        break\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_policies_import_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import kvtier.policies.lru_pure, kvtier.policies.arc; "
            "print(sorted(m for m in set(sys.modules) - before if not m.startswith('kvtier')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "yaml" not in out.stdout and "torch" not in out.stdout, out.stdout


def _imported_modules(path: Path, at_import: bool, type_checking: bool = True) -> set[str]:
    """Absolute module names `path` imports: when the module is imported (`at_import`: not in a
    function body), or anywhere; under `if TYPE_CHECKING:` too unless `type_checking` is False."""
    names: set[str] = set()
    nodes = list(ast.parse(path.read_text()).body)
    while nodes:
        node = nodes.pop()
        if at_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        nodes.extend(ast.iter_child_nodes(node))
    return names


def test_only_the_vllm_integration_package_imports_vllm():
    """vLLM is imported by `kvtier.integrations.vllm` (a package) alone, and nothing else in kvtier
    imports that package: kvtier works without vLLM installed. (A function elsewhere may import
    vLLM to compare with it, e.g. `kvtier bench replay --compare vllm`.)"""
    package = Path(__file__).resolve().parents[1] / "kvtier"
    integration = package / "integrations" / "vllm"
    assert (integration / "__init__.py").is_file()
    inside, outside = [], []
    for path in sorted(package.rglob("*.py")):
        loaded = _imported_modules(path, at_import=True)
        uses = any(n == "vllm" or n.startswith("vllm.") for n in loaded)
        if integration in path.parents:
            inside.append(uses)
        elif uses or any(n.startswith("kvtier.integrations.vllm") for n in _imported_modules(path, at_import=False)):
            outside.append(str(path.relative_to(package)))
    assert outside == [], f"outside kvtier/integrations/vllm/: {outside} import vllm or the integration"
    assert any(inside)


def test_the_block_table_sits_below_policies_and_tiers():
    """`kvtier.index` (the block table) imports only the bottom layer (keys, types, errors, quoting), as
    ARCHITECTURE.md's import direction puts it beside the policies, under the tiers."""
    package = Path(__file__).resolve().parents[1] / "kvtier" / "index"
    imported = set().union(*(_imported_modules(path, at_import=False) for path in package.glob("*.py")))
    kvtier_modules = {name for name in imported if name.split(".")[0] == "kvtier"}
    allowed = {"kvtier.core.errors", "kvtier.core.keys", "kvtier.core.quoting", "kvtier.core.types",
               "kvtier.index.pure", "kvtier.index.status", "kvtier.index.table"}
    assert kvtier_modules <= allowed, kvtier_modules


# The packages of kvtier, lowest first (README, "Layout"): when a module is imported, it imports
# only modules of its own package or of packages before its own. Imports inside functions (lazy)
# and under `if TYPE_CHECKING:` are not counted: neither runs when the module is imported.
PACKAGE_ORDER = ["core", "index", "policies", "tiers", "transfer", "config", "control", "host", "standalone",
                 "testing", "bench", "cli", "integrations"]
# The one upward import allowed: a tier kind (a package `kvtier.tiers.<kind>`, any module in it) builds
# the handlers it brings on the handler contract, `kvtier.transfer.handlers.base`, which its backend
# declares (`Backend.handlers`; ARCHITECTURE.md, "A layout that is a map": `tiers/<kind>/` registers
# its backend, spec and handlers). Nothing else of `transfer`, and nothing outside a kind's package
# (`kvtier.tiers.base`, `kvtier.tiers.room`, ...): README, "A tier kind of your own".
HANDLER_CONTRACT = "kvtier.transfer.handlers.base"


def upward_allowed(module: str, name: str, package: Path) -> bool:
    """Whether `module` (a module of the kvtier package at `package`) may import `name` from a later
    package: a tier kind's package importing the handler contract."""
    parts = module.split(".")
    return (name == HANDLER_CONTRACT and len(parts) >= 3 and parts[:2] == ["kvtier", "tiers"]
            and (package / "tiers" / parts[2] / "__init__.py").is_file())


def upward_imports(package: Path) -> list[str]:
    """Each "M imports N" where a module M of the kvtier package at `package` imports, when it is
    imported, a module N of a package after its own in PACKAGE_ORDER that `upward_allowed` does not
    allow."""
    upward = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        if len(rel.parts) < 3:
            continue  # kvtier/__init__.py: the public API, above everything
        own = PACKAGE_ORDER.index(rel.parts[1])
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for name in _imported_modules(path, at_import=True, type_checking=False):
            parts = name.split(".")
            if parts[0] != "kvtier" or len(parts) < 2 or parts[1] not in PACKAGE_ORDER:
                continue
            if PACKAGE_ORDER.index(parts[1]) > own and not upward_allowed(module, name, package):
                upward.append(f"{module} imports {name}")
    return upward


def test_packages_import_only_packages_below_them():
    package = Path(__file__).resolve().parents[1] / "kvtier"
    assert sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file()) == sorted(PACKAGE_ORDER)
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py"], "a module outside the packages"
    assert upward_imports(package) == []
