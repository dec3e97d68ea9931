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


def has_handler(src_spec: str, dst_spec: str) -> bool:
    return (src_spec, dst_spec) in HANDLERS
