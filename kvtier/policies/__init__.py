"""Replacement policies (stdlib only). Select by name in YAML: `lru`, `arc`, or `package.module:Class`."""

from kvtier.policies.arc import ARCCachePolicy
from kvtier.policies.base import CachePolicy
from kvtier.policies.lru import LRUCachePolicy

__all__ = ["ARCCachePolicy", "CachePolicy", "LRUCachePolicy"]
