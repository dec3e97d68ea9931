"""Issue 28's size rules for everything under kvtier/: no module over 400 lines (Cython's .pyx,
.pxd and .pxi files too), no class over 250, no function over 50, no class with more than 15
public methods (20 for a class implementing vLLM's `OffloadingManager` contract, whose own
interface has that many).

Read with `ast` (no imports), so a module that fails to import still gets measured. The failure
message names every offender with its size, so one run lists all the work left."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 50
MAX_PUBLIC_METHODS = 15
MAX_PUBLIC_METHODS_MANAGER = 20  # a class whose bases name OffloadingManager
PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"


def _span(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first decorator to the end of the definition."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return (node.end_lineno or node.lineno) - start + 1


def _implements_manager(node: ast.ClassDef) -> bool:
    return any("OffloadingManager" in ast.unparse(base) for base in node.bases)


def _public_methods(node: ast.ClassDef) -> int:
    return sum(1 for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
               and not item.name.startswith("_"))


def _class_problems(name: str, node: ast.ClassDef) -> list[str]:
    found = []
    size = _span(node)
    if size > MAX_CLASS_LINES:
        found.append(f"{name}:{node.lineno} class {node.name}: {size} lines (class limit {MAX_CLASS_LINES})")
    limit = MAX_PUBLIC_METHODS_MANAGER if _implements_manager(node) else MAX_PUBLIC_METHODS
    methods = _public_methods(node)
    if methods > limit:
        found.append(f"{name}:{node.lineno} class {node.name}: {methods} public methods (limit {limit})")
    return found


def oversized(root: Path = PACKAGE) -> list[str]:
    """One line per offender: 'path: N lines' for a module, 'path:line class C: ...' for a class
    (nested ones included) and 'path:line function f: N lines' for a function or method."""
    found = []
    cython = [*root.rglob("*.pyx"), *root.rglob("*.pxd"), *root.rglob("*.pxi")]
    for path in sorted(cython):  # Cython sources and declarations: module lines only (no ast)
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root.parent).as_posix()}: {lines} lines (module limit {MAX_MODULE_LINES})")
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(root.parent).as_posix()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{name}: {lines} lines (module limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                found.extend(_class_problems(name, node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(node) > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} function {node.name}: {_span(node)} lines "
                             f"(function limit {MAX_FUNCTION_LINES})")
    return found


def test_no_module_class_or_function_over_the_size_limits():
    assert PACKAGE.is_dir()
    offenders = oversized()
    assert not offenders, "split these (issue 28):\n" + "\n".join(offenders)


def test_the_size_check_names_offenders(tmp_path):
    """The checker itself: each kind of offender is reported, and nothing within the limits."""
    pkg = tmp_path / "kvtier"
    pkg.mkdir()
    (pkg / "small.py").write_text("class Small:\n    def a(self):\n        return 1\n")
    (pkg / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    body = "".join(f"    a{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    (pkg / "wide.py").write_text("@decorator\nclass Wide:\n" + body)
    (pkg / "long.pyx").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (pkg / "long.pxd").write_text("cdef int x\n" * (MAX_MODULE_LINES + 1))
    lines = "".join("    x = 1\n" for _ in range(MAX_FUNCTION_LINES))
    (pkg / "func.py").write_text("def f():\n" + lines)
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_PUBLIC_METHODS + 1))
    (pkg / "many.py").write_text("class Many:\n" + methods + "    def _private(self):\n        pass\n")
    manager = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_PUBLIC_METHODS_MANAGER))
    (pkg / "mgr.py").write_text("class M(OffloadingManager):\n" + manager)
    assert oversized(pkg) == [
        f"kvtier/long.pxd: {MAX_MODULE_LINES + 1} lines (module limit {MAX_MODULE_LINES})",
        f"kvtier/long.pyx: {MAX_MODULE_LINES + 1} lines (module limit {MAX_MODULE_LINES})",
        f"kvtier/func.py:1 function f: {MAX_FUNCTION_LINES + 1} lines (function limit {MAX_FUNCTION_LINES})",
        f"kvtier/long.py: {MAX_MODULE_LINES + 1} lines (module limit {MAX_MODULE_LINES})",
        f"kvtier/many.py:1 class Many: {MAX_PUBLIC_METHODS + 1} public methods (limit {MAX_PUBLIC_METHODS})",
        f"kvtier/wide.py:2 class Wide: {MAX_CLASS_LINES + 2} lines (class limit {MAX_CLASS_LINES})",
    ]
