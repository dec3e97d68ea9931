"""Replacement policies. Select by name in YAML: `lru`, `arc`, `sieve`, `prefix-freq`, or `package.module:Class`.

`LRUCachePolicy` and `PrefixFreqCachePolicy` are the classes the registered names `lru` and `prefix-freq`
give: compiled indexes (lru_compiled.py, prefix_compiled.py), each its pure-Python fallback where the
extension was not built. `PureLRUCachePolicy` and `PurePrefixFreqCachePolicy` (lru_pure.py,
prefix_pure.py) are the pure-Python twins that make the same decisions: the reference the compiled
classes are tested against. They, `ARCCachePolicy` and `SIEVECachePolicy` are a pure block table
composed with a pure order over keys (pure.py: `PurePolicy`); the compiled ones, a compiled table
composed with a compiled order. A policy written to vLLM's contract holds its own blocks instead.
"""

from kvtier.policies.arc import ARCCachePolicy
from kvtier.policies.base import CachePolicy
from kvtier.policies.lru_compiled import LRUCachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy
from kvtier.policies.prefix_compiled import PrefixFreqCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.policies.sieve import SIEVECachePolicy

__all__ = ["ARCCachePolicy", "CachePolicy", "LRUCachePolicy", "PrefixFreqCachePolicy", "PureLRUCachePolicy",
           "PurePrefixFreqCachePolicy", "SIEVECachePolicy"]
