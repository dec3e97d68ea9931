"""Name -> class for backends and policies, and (source spec, destination spec) -> handler factory.

Entries are "module:attribute" strings, imported only when used, so that reading a config or
listing what exists never imports torch or kvikio. Anything not listed can be named directly as
"package.module:Class" in YAML: importing it runs that module's code, so a config is trusted input,
like code. `check_name` locates such a module without importing anything (`kvtier config check`);
`load_class` imports it and checks the class (building a hierarchy).

The handler table is filled from the backend classes: each declares the hops it brings
(`Backend.handlers`), entered when the class is loaded; `register_handler` adds others.
Handler factories have the signature
    factory(backends: Mapping[str, Backend], kv_caches: CanonicalKVCaches | None) -> TransferHandler | None
and return None when they cannot serve in this process (e.g. a GPU handler without KV caches).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any

from kvtier.core.errors import ConfigError, KVTierError
from kvtier.core.quoting import brief, clip, suggest

# One line per tier kind: its YAML name and its backend class. A kind's package holds its backend,
# its spec type and the hops it brings (`Backend.handlers`), entered into the handler table below
# when the class is loaded; a class named "package.module:Class" in YAML brings its hops the same way.
BACKENDS: dict[str, str] = {
    "cpu": "kvtier.tiers.cpu:CPUBackend",
    "file": "kvtier.tiers.file:FileBackend",
    "memory": "kvtier.tiers.memory:MemoryBackend",
    "valkey": "kvtier.tiers.remote:ValkeyBackend",
}

POLICIES: dict[str, str] = {
    "lru": "kvtier.policies.lru_compiled:LRUCachePolicy",  # pure-Python PureLRUCachePolicy when not built
    "arc": "kvtier.policies.arc:ARCCachePolicy",
    "sieve": "kvtier.policies.sieve:SIEVECachePolicy",
    "prefix-freq": "kvtier.policies.prefix_compiled:PrefixFreqCachePolicy",  # pure-Python when not built
}


@dataclass(frozen=True)
class Kind:
    """A kind of code a config names: its word in messages, its registered names, its base class."""

    word: str
    names: dict[str, str]
    base: str  # "module:Class" every class of this kind derives from...
    seed_methods: tuple[str, ...] = ()  # ...or, failing that, has all of these (vLLM's earlier contract)


BACKEND = Kind("backend", BACKENDS, "kvtier.tiers.base:Backend")
POLICY = Kind("policy", POLICIES, "kvtier.policies.base:CachePolicy", ("get", "insert", "remove", "touch", "evict"))

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


# ---------------------------------------------------------------------- handlers
# One table, (source spec type, destination spec type) -> factory (a callable or a "module:attr"
# path to one), and one matching rule (`spec_pairs`), the router's too (`TransferRouter.handler_for`):
# a job from spec type `S` to `D` is served by the entry of the first pair `(s, d)` registered, with
# `s` walking `S.__mro__` and, for each `s`, `d` walking `D.__mro__` (the most specific first). So a
# backend whose `spec_type` subclasses a built-in spec gets that spec's handler, and a registered
# pair of its own types takes precedence.

_handlers: dict[tuple[type, type], Any] = {}
_builtins_entered = False


def _table() -> dict[tuple[type, type], Any]:
    """The handler table, with the hops of every backend in `BACKENDS` entered (first) on first use."""
    global _builtins_entered
    if not _builtins_entered:
        for path in BACKENDS.values():
            _enter_hops(load_object(path))  # two threads racing here enter the same entries
        _builtins_entered = True
    return _handlers


def enter_kind(backend_cls: type) -> None:
    """Enter the hops `backend_cls` declares (`Backend.handlers`: (source spec type, destination
    spec type, factory) triples) into the handler table, as `register_handler` would; a pair
    already served by the same factory is left as it is. Raises `KVTierError` for a malformed
    declaration or a pair another factory serves."""
    _table()
    _enter_hops(backend_cls)


def _enter_hops(backend_cls: type) -> None:
    """`enter_kind` without the table's first fill: every hop is checked before any is entered,
    so a refused class leaves the table as it was."""
    entering: dict[tuple[type, type], Any] = {}
    for n, hop in enumerate(getattr(backend_cls, "handlers", ())):
        where = f"{backend_cls.__qualname__}.handlers[{n}]"
        if not (isinstance(hop, tuple) and len(hop) == 3 and _is_spec_type(hop[0]) and _is_spec_type(hop[1])
                and _is_factory(hop[2])):
            raise KVTierError(f"{where} is {brief(hop, 120)}; write (source spec type, destination spec type, "
                              "factory or 'module:attr'), the spec types LoadStoreSpec subclasses")
        pair = (hop[0], hop[1])
        held = entering.setdefault(pair, _handlers.get(pair, hop[2]))
        if held is not hop[2] and _factory_name(held) != _factory_name(hop[2]):
            raise KVTierError(f"{where}: {_spec_name(pair[0])} -> {_spec_name(pair[1])} is already served by "
                              f"{_factory_name(held)}; one factory serves a pair")
    for pair, factory in entering.items():
        _handlers.setdefault(pair, factory)


def _is_spec_type(spec_type: Any) -> bool:
    from kvtier.core.specs import LoadStoreSpec

    return isinstance(spec_type, type) and issubclass(spec_type, LoadStoreSpec)


def _is_factory(factory: Any) -> bool:
    return callable(factory) or isinstance(factory, str)


def _check_spec_type(what: str, spec_type: Any) -> None:
    from kvtier.core.errors import ArgumentTypeError

    if not _is_spec_type(spec_type):
        raise ArgumentTypeError(f"register_handler: {what} must be a LoadStoreSpec subclass (a backend's "
                                f"spec_type), got {spec_type!r}")


def register_handler(src_spec: type, dst_spec: type, factory: Any) -> None:
    """Serve jobs from `src_spec` to `dst_spec` (LoadStoreSpec types; their subclasses too, see the
    matching rule above) with the handlers `factory` makes.

    `factory(backends, kv_caches) -> TransferHandler | None` is called once per hierarchy built
    with a backend of each type (`kv_caches` is None without an engine KV cache); it picks the
    backends it can serve by capability (`kvtier.tiers.base`) and returns None when it cannot serve
    in this process. It may be given as a "module:attr" path, imported only when first needed.
    Raises `KVTierError` if the pair already has a handler (`unregister_handler` it first).
    """
    from kvtier.core.errors import ArgumentTypeError

    _check_spec_type("src_spec", src_spec)
    _check_spec_type("dst_spec", dst_spec)
    if not _is_factory(factory):
        raise ArgumentTypeError("register_handler: factory must be a callable or a 'module:attr' path, "
                                f"got {factory!r}")
    table = _table()
    pair = (src_spec, dst_spec)
    if pair in table:
        raise KVTierError(f"a handler for {_spec_name(src_spec)} -> {_spec_name(dst_spec)} is already registered "
                          f"({_factory_name(table[pair])}); call unregister_handler first to replace it")
    table[pair] = factory


def unregister_handler(src_spec: type, dst_spec: type) -> None:
    """Remove the handler registered for exactly this pair. Raises `KVTierError` if there is none."""
    if _table().pop((src_spec, dst_spec), None) is None:
        raise KVTierError(f"no handler is registered for {_spec_name(src_spec)} -> {_spec_name(dst_spec)}")


def spec_pairs(src_spec: type, dst_spec: type) -> list[tuple[type, type]]:
    """The pairs a job from `src_spec` to `dst_spec` may be served under, most specific first:
    the matching rule, for any table keyed by (source spec type, destination spec type)."""
    return [(s, d) for s in src_spec.__mro__ for d in dst_spec.__mro__]


def _match(src_spec: type, dst_spec: type) -> tuple[type, type] | None:
    """The registered pair that serves `src_spec -> dst_spec` under the matching rule, or None."""
    table = _table()
    return next((pair for pair in spec_pairs(src_spec, dst_spec) if pair in table), None)


def handler_factory(src_spec: type, dst_spec: type) -> Any:
    """The factory that serves `src_spec -> dst_spec` (imported if registered by path), or None."""
    pair = _match(src_spec, dst_spec)
    if pair is None:
        return None
    factory = _handlers[pair]
    if isinstance(factory, str):
        factory = _handlers[pair] = load_object(factory)
    return factory


def handler_pairs(spec_types: Any) -> list[tuple[type, type]]:
    """The registered pairs that serve some job between the given spec types (the spec types of
    a hierarchy's backends, and `GPULoadStoreSpec` with an engine KV cache), in registration
    order: build one handler per pair and register it under that pair with the router, whose
    matching rule is this one."""
    present = list(dict.fromkeys(spec_types))
    used = {_match(s, d) for s in present for d in present}
    return [pair for pair in _table() if pair in used]


def has_handler(src_spec: Any, dst_spec: Any) -> bool:
    """Whether a handler is registered for jobs from `src_spec` to `dst_spec`: LoadStoreSpec types
    (preferred), or class names (`"CPULoadStoreSpec"`) of specs already imported."""
    src, dst = _spec_type_of(src_spec), _spec_type_of(dst_spec)
    return src is not None and dst is not None and _match(src, dst) is not None


def _spec_type_of(spec: Any) -> type | None:
    """A spec type given as itself or by class name (the first imported LoadStoreSpec so named)."""
    if not isinstance(spec, str):
        return spec
    from kvtier.core.specs import LoadStoreSpec

    pending: list[type] = [LoadStoreSpec]
    while pending:
        cls = pending.pop(0)
        if cls.__name__ == spec:
            return cls
        pending.extend(cls.__subclasses__())
    return None


def _spec_name(spec_type: Any) -> str:
    return getattr(spec_type, "__qualname__", repr(spec_type))


def _factory_name(factory: Any) -> str:
    if isinstance(factory, str):
        return factory
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"


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
        return (f"{brief(name)} is not a {kind.word} name: write one of {', '.join(kind.names)} "
                "or 'package.module:Class'")
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
    if not issubclass(obj, base) and not (kind.seed_methods and _has_methods(obj, kind.seed_methods)):
        alternative = f" nor has the methods {', '.join(kind.seed_methods)}" if kind.seed_methods else ""
        raise ConfigError([(field, f"{kind.word} {brief(name)} names class {obj.__qualname__}, which does not derive "
                                   f"from {kind.base}{alternative}")])
    if kind is POLICY:
        problem = policy_class_problem(obj)
        if problem:
            raise ConfigError([(field, f"policy {brief(name)}: {problem}")])
    if kind is BACKEND:
        try:
            enter_kind(obj)
        except KVTierError as exc:
            raise ConfigError([(field, f"backend {brief(name)}: {exc}")]) from None
    return obj


# vLLM's own policies, by class name -> the kvtier built-in that makes the same choices
_VLLM_EQUIVALENTS = {"LRUCachePolicy": "lru", "ARCCachePolicy": "arc"}


def policy_class_problem(cls: type) -> str | None:
    """Why the policy class `cls` cannot be built as `cls(capacity)` and driven by a tier; None if
    nothing is known against it. Refused: vLLM's own `CachePolicy` classes (their contract differs:
    `touch(keys, req_context)`, and they evict only what `mark_evictable` released, which kvtier
    never calls), abstract classes, and an `__init__` that cannot take one positional capacity (a
    class without an inspectable signature is not judged)."""
    if _is_vllm_policy(cls):
        same = _VLLM_EQUIVALENTS.get(cls.__name__)
        use = f"kvtier's built-in {same!r}, which makes the same choices" if same else "kvtier's 'lru' or 'arc'"
        return (f"vLLM's CachePolicy classes use a different contract (touch with a req_context; evict only "
                f"after mark_evictable, never called here): this tier would never evict; use {use}")
    missing = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if missing:
        return f"{cls.__qualname__} is abstract: it does not implement {', '.join(missing)}"
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a class without an inspectable signature is not judged
        return None
    try:
        signature.bind(1)
    except TypeError as exc:
        return (f"{cls.__qualname__} cannot be built as {cls.__qualname__}(capacity): its signature is "
                f"{clip(str(signature), 80)}, {exc}")
    return None


def _is_vllm_policy(cls: type) -> bool:
    """Whether `cls` follows vLLM's own CachePolicy contract: a subclass of vLLM's base (looked up
    only where a class has already imported it: vllm is never imported here), or a class with
    vLLM's `mark_evictable` that is not a kvtier policy and lacks kvtier's `evictable` notice."""
    vllm_base = getattr(sys.modules.get("vllm.v1.kv_offload.cpu.policies.base"), "CachePolicy", None)
    if isinstance(vllm_base, type) and issubclass(cls, vllm_base):
        return True
    kvtier_base = load_object(POLICY.base)
    return (not issubclass(cls, kvtier_base) and callable(getattr(cls, "mark_evictable", None))
            and not callable(getattr(cls, "evictable", None)))


def _has_methods(cls: type, names: tuple[str, ...]) -> bool:
    return all(callable(getattr(cls, name, None)) for name in names)


def _a(obj: Any) -> str:
    kind = "function" if callable(obj) else type(obj).__name__
    return f"a {kind}" if kind[:1].lower() not in "aeiou" else f"an {kind}"
