"""Name -> class for backends and policies, and (source spec, destination spec) -> handler factory.

Entries are "module:attribute" strings, imported only when used, so that reading a config or
listing what exists never imports torch or kvikio. Anything not listed can be named directly as
"package.module:Class" in YAML: importing it runs that module's code, so a config is trusted input,
like code. `check_name` locates such a module without importing anything (`kvtier config check`);
`load_class` imports it and checks the class (building a hierarchy).

Handler factories have the signature
    factory(backends: Mapping[str, Backend], kv_caches: CanonicalKVCaches | None) -> TransferHandler | None
and return None when they cannot serve in this process (e.g. a GPU handler without KV caches).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
import sys
from dataclasses import dataclass
from typing import Any

from kvtier.config_input import brief, clip, suggest
from kvtier.errors import ConfigError

BACKENDS: dict[str, str] = {
    "cpu": "kvtier.tiers.cpu:CPUBackend",
    "file": "kvtier.tiers.file:FileBackend",
    "memory": "kvtier.tiers.memory:MemoryBackend",
}

POLICIES: dict[str, str] = {
    "lru": "kvtier.policies.lru:LRUCachePolicy",
    "arc": "kvtier.policies.arc:ARCCachePolicy",
    "sieve": "kvtier.policies.sieve:SIEVECachePolicy",
    "prefix-freq": "kvtier.policies.prefix:PrefixFreqCachePolicy",
}

# (source spec class name, destination spec class name) -> handler factory.
HANDLERS: dict[tuple[str, str], str] = {
    ("CPULoadStoreSpec", "CPULoadStoreSpec"): "kvtier.handlers.memory:MemoryCopyHandler.for_backends",
    ("CPULoadStoreSpec", "FileLoadStoreSpec"): "kvtier.handlers.cpu_file:make_cpu_to_file",
    ("FileLoadStoreSpec", "CPULoadStoreSpec"): "kvtier.handlers.cpu_file:make_file_to_cpu",
    ("GPULoadStoreSpec", "CPULoadStoreSpec"): "kvtier.handlers.gpu_cpu:make_gpu_to_cpu",
    ("CPULoadStoreSpec", "GPULoadStoreSpec"): "kvtier.handlers.gpu_cpu:make_cpu_to_gpu",
    ("GPULoadStoreSpec", "FileLoadStoreSpec"): "kvtier.handlers.gpu_file:make_gpu_to_file",
    ("FileLoadStoreSpec", "GPULoadStoreSpec"): "kvtier.handlers.gpu_file:make_file_to_gpu",
}


@dataclass(frozen=True)
class Kind:
    """A kind of code a config names: its word in messages, its registered names, its base class."""

    word: str
    names: dict[str, str]
    base: str  # "module:Class" every class of this kind derives from


BACKEND = Kind("backend", BACKENDS, "kvtier.tiers.base:Backend")
POLICY = Kind("policy", POLICIES, "kvtier.policies.base:CachePolicy")

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")


def load_object(path: str) -> Any:
    """Import "package.module:attr.attr" and return the attribute."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form 'package.module:Name'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve(kind: dict[str, str], name: str) -> Any:
    """A registered name or a "module:Class" path -> the object. Raises ImportError/AttributeError/ValueError."""
    return load_object(kind.get(name, name))


def check_name(kind: Kind, name: str) -> str | None:
    """What is wrong with `name` as a `kind`, found WITHOUT importing or running anything; None if nothing.

    A registered name is fine. Otherwise `name` must be "package.module:Class" and the module must
    exist: the top-level package is located with `importlib.util.find_spec` (which imports nothing
    for a top-level name) and each further part by searching its parent's directories with
    `PathFinder`, so no package's `__init__` runs. Whether the attribute exists and is a class of the
    right kind is known only by importing: see `load_class`.
    """
    if name in kind.names:
        return None
    if len(name) > 256:
        return f"{brief(name)} is not a {kind.word} name: {len(name)} characters long"
    module_name, sep, attr = name.partition(":")
    if not sep:
        return (f"unknown {kind.word} {brief(name)}{suggest(name, kind.names)}; known: {', '.join(kind.names)} "
                f"or 'package.module:Class'")
    if not _DOTTED.match(module_name) or not _DOTTED.match(attr):
        return f"{brief(name)} is not a {kind.word} name: write one of {', '.join(kind.names)} or 'package.module:Class'"
    if not module_exists(module_name):
        return (f"unknown {kind.word} {brief(name)}: no module {brief(module_name)} is installed; known: "
                f"{', '.join(kind.names)} or 'package.module:Class'")
    return None


def module_exists(module_name: str) -> bool:
    """Whether `import module_name` would find a module, without importing it or its parents."""
    if module_name in sys.modules:
        return True
    top, *rest = module_name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    name = top
    for part in rest:
        loaded = sys.modules.get(name)
        locations = getattr(loaded, "__path__", None) if loaded is not None else getattr(
            spec, "submodule_search_locations", None)
        if locations is None:  # not a package: it has no submodules
            return False
        name = f"{name}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(name, list(locations))
        if spec is None:
            return False
    return spec is not None


def load_class(kind: Kind, name: str, field: str) -> type:
    """Import the class `name` names (a registered name or "package.module:Class") and check it is a
    class derived from the kind's base. Runs the module's import-time code: a config is trusted input.

    Raises `ConfigError` naming `field` for an unknown name, a module that fails to import, a missing
    attribute, or an object that is not such a class.
    """
    problem = check_name(kind, name)
    if problem:
        raise ConfigError([(field, problem)])
    path = kind.names.get(name, name)
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # whatever the module raises at import
        raise ConfigError([(field, f"{kind.word} {brief(name)}: importing module {module_name!r} failed: "
                                   f"{type(exc).__name__}: {clip(str(exc))}")]) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError([(field, f"{kind.word} {brief(name)}: {brief(obj, 80)} has no attribute {part!r}")])
        obj = getattr(obj, part)
    base = load_object(kind.base)
    if not isinstance(obj, type):
        raise ConfigError([(field, f"{kind.word} {brief(name)} names {_a(obj)}, not a class; a {kind.word} is a "
                                   f"class derived from {kind.base}")])
    if not issubclass(obj, base):
        raise ConfigError([(field, f"{kind.word} {brief(name)} names class {obj.__qualname__}, which does not derive "
                                   f"from {kind.base}")])
    return obj


def _a(obj: Any) -> str:
    kind = "function" if callable(obj) else type(obj).__name__
    return f"a {kind}" if kind[:1].lower() not in "aeiou" else f"an {kind}"


def has_handler(src_spec: str, dst_spec: str) -> bool:
    return (src_spec, dst_spec) in HANDLERS
