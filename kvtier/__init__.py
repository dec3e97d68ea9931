"""kvtier: a multi-tier KV-cache storage hierarchy (GPU -> pinned CPU -> NVMe files).

Only light modules are imported here; torch, numpy and kvikio are imported by the modules that
move or hold bytes, when they are used.
"""

from kvtier.config import HierarchyConfig, load_config, load_config_text, parse_config, parse_size
from kvtier.engine import TransferEngine
from kvtier.errors import (
                           ArgumentError,
                           ArgumentTypeError,
                           ClosedError,
                           ConfigError,
                           IntegrityError,
                           KVTierError,
                           TransferError,
)
from kvtier.hierarchy import Hierarchy, build_hierarchy
from kvtier.interfaces import OffloadingManager
from kvtier.keys import OffloadKey, get_offload_block_hash, get_offload_group_idx, make_offload_key
from kvtier.lru_manager import LRUOffloadingManager
from kvtier.manager import HierarchyManager, Tier
from kvtier.policies import ARCCachePolicy, CachePolicy, LRUCachePolicy
from kvtier.specs import (
                           BlockIDsLoadStoreSpec,
                           CompositeLoadStoreSpec,
                           CPULoadStoreSpec,
                           FileLoadStoreSpec,
                           GPULoadStoreSpec,
                           LoadStoreSpec,
)
from kvtier.tiers.base import Backend
from kvtier.types import (
                           BlockStatus,
                           CanonicalKVCacheRef,
                           CanonicalKVCaches,
                           CanonicalKVCacheTensor,
                           LookupResult,
                           Medium,
                           OffloadingEvent,
                           PrepareStoreOutput,
                           ReqContext,
                           RequestOffloadingContext,
                           TransferResult,
)

__version__ = "0.1.0"

__all__ = [
    "ARCCachePolicy", "ArgumentError", "ArgumentTypeError", "Backend", "BlockIDsLoadStoreSpec", "BlockStatus", "CPULoadStoreSpec", "CachePolicy",
    "CanonicalKVCacheRef", "CanonicalKVCacheTensor", "CanonicalKVCaches", "ClosedError", "CompositeLoadStoreSpec",
    "ConfigError",
    "FileLoadStoreSpec", "GPULoadStoreSpec", "Hierarchy", "HierarchyConfig", "HierarchyManager", "IntegrityError",
    "KVTierError", "LRUCachePolicy", "LRUOffloadingManager", "LoadStoreSpec", "LookupResult", "Medium",
    "OffloadKey", "OffloadingEvent", "OffloadingManager", "PrepareStoreOutput", "ReqContext",
    "RequestOffloadingContext", "Tier", "TransferEngine", "TransferError", "TransferResult", "build_hierarchy",
    "get_offload_block_hash", "get_offload_group_idx", "load_config", "load_config_text", "make_offload_key",
    "parse_config", "parse_size",
]
