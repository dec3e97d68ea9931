"""Name -> class for backends and policies, and (source spec, destination spec) -> handler factory.

Entries are "module:attribute" strings, imported only when used, so that reading a config or
listing what exists never imports torch or kvikio. Anything not listed can be named directly as
"package.module:Class" in YAML.

Handler factories have the signature
    factory(backends: Mapping[str, Backend], kv_caches: CanonicalKVCaches | None) -> TransferHandler | None
and return None when they cannot serve in this process (e.g. a GPU handler without KV caches).
"""

from __future__ import annotations

import importlib
from typing import Any

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

# The built-in handlers: (source spec, destination spec, factory), each a "module:attr" path. They
# are entered into the handler table on its first use (`_table`), so importing this module imports
# no spec, handler, torch or kvikio.
BUILTIN_HANDLERS: tuple[tuple[str, str, str], ...] = (
    ("kvtier.specs:CPULoadStoreSpec", "kvtier.specs:CPULoadStoreSpec", "kvtier.handlers.memory:MemoryCopyHandler.for_backends"),
    ("kvtier.specs:CPULoadStoreSpec", "kvtier.specs:FileLoadStoreSpec", "kvtier.handlers.cpu_file:make_cpu_to_file"),
    ("kvtier.specs:FileLoadStoreSpec", "kvtier.specs:CPULoadStoreSpec", "kvtier.handlers.cpu_file:make_file_to_cpu"),
    ("kvtier.specs:GPULoadStoreSpec", "kvtier.specs:CPULoadStoreSpec", "kvtier.handlers.gpu_cpu:make_gpu_to_cpu"),
    ("kvtier.specs:CPULoadStoreSpec", "kvtier.specs:GPULoadStoreSpec", "kvtier.handlers.gpu_cpu:make_cpu_to_gpu"),
    ("kvtier.specs:GPULoadStoreSpec", "kvtier.specs:FileLoadStoreSpec", "kvtier.handlers.gpu_file:make_gpu_to_file"),
    ("kvtier.specs:FileLoadStoreSpec", "kvtier.specs:GPULoadStoreSpec", "kvtier.handlers.gpu_file:make_file_to_gpu"),
)


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
# path to one), and one matching rule (`spec_pairs`), the router's too (`TransferEngine.handler_for`):
# a job from spec type `S` to `D` is served by the entry of the first pair `(s, d)` registered, with
# `s` walking `S.__mro__` and, for each `s`, `d` walking `D.__mro__` (the most specific first). So a
# backend whose `spec_type` subclasses a built-in spec gets that spec's handler, and a registered
# pair of its own types takes precedence.

_handlers: dict[tuple[type, type], Any] = {}
_builtins_entered = False


def _table() -> dict[tuple[type, type], Any]:
    """The handler table, with the built-ins entered (first) on first use."""
    global _builtins_entered
    if not _builtins_entered:
        builtins = {(load_object(src), load_object(dst)): factory for src, dst, factory in BUILTIN_HANDLERS}
        _handlers.update(builtins)  # two threads racing here enter the same entries
        _builtins_entered = True
    return _handlers


def _check_spec_type(what: str, spec_type: Any) -> None:
    from kvtier.errors import ArgumentTypeError
    from kvtier.specs import LoadStoreSpec

    if not (isinstance(spec_type, type) and issubclass(spec_type, LoadStoreSpec)):
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
    from kvtier.errors import ArgumentTypeError, KVTierError

    _check_spec_type("src_spec", src_spec)
    _check_spec_type("dst_spec", dst_spec)
    if not (callable(factory) or isinstance(factory, str)):
        raise ArgumentTypeError(f"register_handler: factory must be a callable or a 'module:attr' path, got {factory!r}")
    table = _table()
    pair = (src_spec, dst_spec)
    if pair in table:
        raise KVTierError(f"a handler for {_spec_name(src_spec)} -> {_spec_name(dst_spec)} is already registered "
                          f"({_factory_name(table[pair])}); call unregister_handler first to replace it")
    table[pair] = factory


def unregister_handler(src_spec: type, dst_spec: type) -> None:
    """Remove the handler registered for exactly this pair. Raises `KVTierError` if there is none."""
    from kvtier.errors import KVTierError

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
    from kvtier.specs import LoadStoreSpec

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
