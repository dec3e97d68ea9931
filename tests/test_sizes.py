"""Issue 15's size rule: no module under kvtier/ over 500 lines, no class over 300 lines.

Read with `ast` (no imports), so a module that fails to import still gets measured. The failure
message names every offender with its size, so one run lists all the work left."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
PACKAGE = Path(__file__).resolve().parent.parent / "kvtier"


def oversized(root: Path = PACKAGE) -> list[str]:
    """'path: N lines' for each module over MAX_MODULE_LINES and 'path:line Class: N lines' for
    each class (nested ones included) over MAX_CLASS_LINES, decorators counted."""
    found = []
    for path in sorted([*root.rglob("*.pyx"), *root.rglob("*.pxi")]):  # Cython: module lines only (no ast)
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
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                size = (node.end_lineno or node.lineno) - start + 1
                if size > MAX_CLASS_LINES:
                    limit = f"class limit {MAX_CLASS_LINES}"
                    found.append(f"{name}:{node.lineno} class {node.name}: {size} lines ({limit})")
    return found


def test_no_module_or_class_over_the_size_limits():
    assert PACKAGE.is_dir()
    offenders = oversized()
    assert not offenders, "split these (issue 15):\n" + "\n".join(offenders)


def test_the_size_check_names_offenders(tmp_path):
    """The checker itself: an oversized module and an oversized class are both reported."""
    pkg = tmp_path / "kvtier"
    pkg.mkdir()
    (pkg / "small.py").write_text("class Small:\n    x = 1\n")
    (pkg / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    body = "".join(f"    a{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    (pkg / "wide.py").write_text("@decorator\nclass Wide:\n" + body)
    (pkg / "long.pyx").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(pkg) == [
        f"kvtier/long.pyx: {MAX_MODULE_LINES + 1} lines (module limit {MAX_MODULE_LINES})",
        f"kvtier/long.py: {MAX_MODULE_LINES + 1} lines (module limit {MAX_MODULE_LINES})",
        f"kvtier/wide.py:2 class Wide: {MAX_CLASS_LINES + 2} lines (class limit {MAX_CLASS_LINES})",
    ]
