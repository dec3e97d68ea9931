"""kvtier: a multi-tier KV-cache storage hierarchy (GPU -> pinned CPU -> NVMe files).

Only light modules are imported here; torch, numpy and kvikio are imported by the modules that
move or hold bytes, when they are used.
"""

from kvtier.config import HierarchyConfig, load_config, load_config_text, parse_config, parse_size
from kvtier.control.hierarchy import Hierarchy, build_hierarchy
from kvtier.control.lru_manager import LRUOffloadingManager
from kvtier.control.manager import HierarchyManager
from kvtier.core.errors import (
    ArgumentError,
    ArgumentTypeError,
    ClosedError,
    ConfigError,
    IntegrityError,
    KVTierError,
    TransferError,
)
from kvtier.core.interfaces import OffloadingManager
from kvtier.core.keys import OffloadKey, get_offload_block_hash, get_offload_group_idx, make_offload_key
from kvtier.core.specs import (
    BlockIDsLoadStoreSpec,
    CompositeLoadStoreSpec,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
)
from kvtier.core.types import (
    BlockStatus,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from kvtier.policies.arc import ARCCachePolicy
from kvtier.policies.base import CachePolicy
from kvtier.policies.lru_compiled import LRUCachePolicy
from kvtier.policies.prefix_compiled import PrefixFreqCachePolicy
from kvtier.policies.sieve import SIEVECachePolicy
from kvtier.standalone import KVTier
from kvtier.tiers.base import Backend, BlockFile, HostRegion, HostSlots
from kvtier.tiers.file.spec import FileLoadStoreSpec
from kvtier.transfer.handlers.base import TransferHandler
from kvtier.transfer.registry import register_handler

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (dynamic version)

__all__ = [
    # front-ends
    "KVTier", "Hierarchy", "build_hierarchy", "HierarchyManager", "LRUOffloadingManager", "OffloadingManager",
    # configuration
    "HierarchyConfig", "load_config", "load_config_text", "parse_config", "parse_size",
    # policies (every shipped one: `lru` and `prefix-freq` are the registry's compiled classes, pure Python
    # where not built; kvtier.policies also names their pure-Python twins) and the base to write another
    "CachePolicy", "LRUCachePolicy", "ARCCachePolicy", "PrefixFreqCachePolicy", "SIEVECachePolicy",
    # extending: backends, their capabilities, handlers
    "Backend", "HostSlots", "HostRegion", "BlockFile", "TransferHandler", "register_handler",
    # keys, specs and the protocol's value types
    "OffloadKey", "make_offload_key", "get_offload_block_hash", "get_offload_group_idx",
    "LoadStoreSpec", "GPULoadStoreSpec", "CPULoadStoreSpec", "FileLoadStoreSpec", "BlockIDsLoadStoreSpec",
    "CompositeLoadStoreSpec", "BlockStatus", "LookupResult", "OffloadingEvent", "PrepareStoreOutput", "ReqContext",
    "RequestOffloadingContext", "TransferResult", "CanonicalKVCacheRef", "CanonicalKVCacheTensor", "CanonicalKVCaches",
    # errors
    "KVTierError", "ConfigError", "ArgumentError", "ArgumentTypeError", "ClosedError", "IntegrityError",
    "TransferError",
]
