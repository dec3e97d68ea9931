"""Issue 28: tests test behaviour through public interfaces, never a private field of kvtier.

Read with `ast` (nothing is imported), every test file is searched for what reaches a private
name (one leading underscore, not a dunder):

- an attribute `x._name`, unless `x` is `self` or `cls` reading what the test's own class (or a
  class of the same file it derives from) defines: `self._name` inherited from a kvtier class is
  a reach too;
- `setattr`/`getattr`/`delattr`/`hasattr` (`monkeypatch.setattr` too) naming `"_name"`, or a
  dotted target such as `"kvtier.transfer.handlers.file_path._logged"`;
- `from kvtier... import _name`, or `import kvtier...._name`.

`ALLOWED` lists the exceptions, each with its reason: other projects' private names the tests
pin on purpose (vLLM's fields our connector relies on, torch, ctypes), kvtier's compiled
extension modules, imported by name to check they are built. The failure message lists every
new offender as `path:line: expression`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Private names of other projects (or kvtier's compiled modules) that a test may name, by file:
# (path relative to tests/, the expression as `ast.unparse` writes it).
_VLLM_CONNECTOR = "vLLM's private state that KVTierOffloadingConnector (a subclass of vLLM's) relies on"
_NOTICES = ("a pure policy's record of the block table's evictable notices: it has no public reader (the table owns "
            "the count), and the differential tests compare it with the compiled table's count")
ALLOWED: dict[tuple[str, str], str] = {
    ("handlers/test_gpu_cpu.py", "torch.cuda._sleep"): "torch's own busy-wait kernel: keeps a stream busy",
    ("handlers/test_fast_path.py", "out._obj"): "ctypes' byref object: what a fake C function writes through",
    ("integration/test_vllm_policies.py", "m._policy"): "vLLM's CPUOffloadingManager field: the only way to see "
                                                         "which class vLLM's factory picked",
    ("integration/test_vllm_load_failure.py", "side._load_jobs"): _VLLM_CONNECTOR,
    ("integration/test_vllm_load_failure.py", "side._connector_worker_meta"): _VLLM_CONNECTOR,
    ("policies/test_compact_lru.py", "import kvtier.policies._compact_lru"): "the compiled extension, by name",
    ("policies/test_compact_lru.py", "from kvtier.index._table_api import BlockView"): "the compiled extension, "
                                                                                       "by name",
    ("policies/test_compact_lru.py", "from kvtier.index._table_api import CompactTable"): "the compiled extension, "
                                                                                          "by name",
    ("policies/test_compact_lru.py", "from kvtier.index._table_api import CompactOrder"): "the compiled extension, "
                                                                                          "by name",
    ("policies/test_compact_prefix_replay.py", "import kvtier.policies._compact_prefix"): "the compiled extension, "
                                                                                           "by name",
    ("support/policy_state.py", "policy._pinned"): _NOTICES,
}
# Any expression of these forms is another project's (the standard library's) public API.
ALWAYS = {"os._exit", "sys._getframe"}
# Whole files exempt: the connector tests pin many of vLLM's private fields that our connector,
# a subclass of vLLM's, relies on (they read no private name of kvtier).
EXEMPT_FILES = {"integration/test_vllm_connector.py": _VLLM_CONNECTOR}

_ACCESSORS = {"setattr", "getattr", "delattr", "hasattr"}
_DOTTED_PRIVATE = re.compile(r"^kvtier(\.\w+)*\._[A-Za-z0-9]\w*$")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _accessor_target(node: ast.Call) -> str | None:
    """The private name (or dotted target) a setattr-like call names, if any."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in _ACCESSORS:
        return None
    for arg in node.args[:2]:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if _private(arg.value) or _DOTTED_PRIVATE.match(arg.value):
                return f"{name}(..., {arg.value!r})"
    return None


def _defined_in(cls: ast.ClassDef) -> set[str]:
    """The names a class body defines: methods, class attributes and `self.x`/`cls.x` stores."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


def _own_names(tree: ast.AST) -> dict[ast.ClassDef, set[str]]:
    """For each class of a file: what it and its bases of the same file define (the file's own
    state); a class with a base from elsewhere inherits nothing private from it."""
    classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    own: dict[ast.ClassDef, set[str]] = {}

    def names(cls: ast.ClassDef, seen: frozenset[str]) -> set[str]:
        found = _defined_in(cls)
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                found |= names(classes[base.id], seen | {base.id})
        return found

    for cls in classes.values():
        own[cls] = names(cls, frozenset({cls.name}))
    return own


def _self_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """`self._name` in a class that does not define `_name` itself: inherited private state."""
    found = []
    for cls, own in _own_names(tree).items():
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls") and node.attr not in own):
                found.append((node.lineno, ast.unparse(node)))
    return found


def _offences(tree: ast.AST) -> list[tuple[int, str]]:
    found = _self_reaches(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and (target := _accessor_target(node)):
            found.append((node.lineno, target))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier"):
            for alias in node.names:
                if _private(alias.name) or any(_private(part) for part in (node.module or "").split(".")):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvtier") and any(_private(p) for p in alias.name.split(".")):
                    found.append((node.lineno, f"import {alias.name}"))
    return found


def private_reaches(root: Path = TESTS) -> list[str]:
    """`path:line: expression` for each reach of a private name in the tests under `root` that
    `ALLOWED`, `ALWAYS` and `EXEMPT_FILES` do not excuse."""
    out = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in EXEMPT_FILES:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, expression in sorted(set(_offences(tree))):
            if expression not in ALWAYS and (name, expression) not in ALLOWED:
                out.append(f"{name}:{line}: {expression}")
    return out


def test_no_test_reaches_a_private_name():
    offenders = private_reaches()
    assert not offenders, ("tests reach private names (test through a public call, or inject through a public "
                           "seam; see this module's docstring):\n" + "\n".join(offenders))


def test_every_allowed_exception_is_still_used():
    """An exception nobody needs any more is removed from `ALLOWED`, so the list stays the truth."""
    used = set()
    for (name, expression) in ALLOWED:
        path = TESTS / name
        if path.exists():
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            if expression in {e for _, e in _offences(tree)}:
                used.add((name, expression))
    assert set(ALLOWED) - used == set()


def test_the_scan_finds_each_kind_of_reach(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import kvtier.tiers._hidden\n"
        "from kvtier.control.promotion import _expire\n"
        "def test(monkeypatch, handler):\n"
        "    handler._ready[1] = None\n"
        "    monkeypatch.setattr('kvtier.transfer.handlers.file_path._logged', set())\n"
        "    monkeypatch.setattr(handler, '_probes', None)\n"
        "    handler.__class__, os._exit\n"
        "class Fake:\n"
        "    def __init__(self):\n"
        "        self._calls = []\n"
        "class Sub(Fake, TransferHandler):\n"
        "    def submit(self, job_id, src, dst):\n"
        "        self._calls.append(job_id)\n"
        "        self._on_done(job_id)\n")
    assert private_reaches(tmp_path) == [
        "test_x.py:1: import kvtier.tiers._hidden",
        "test_x.py:2: from kvtier.control.promotion import _expire",
        "test_x.py:4: handler._ready",
        "test_x.py:5: setattr(..., 'kvtier.transfer.handlers.file_path._logged')",
        "test_x.py:6: setattr(..., '_probes')",
        "test_x.py:14: self._on_done",
    ]
