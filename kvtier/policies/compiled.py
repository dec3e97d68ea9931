"""Loading a compiled policy index (kvtier/policies/_compact_*.pyx), and the one log line that
says when a registered policy runs its pure-Python fallback instead."""

from __future__ import annotations

import importlib
import logging
from typing import Any, ClassVar

from kvtier.core.limits import MAX_INDEX_BLOCKS, MAX_KEY_BYTES

log = logging.getLogger("kvtier.policies")


class CompiledIndex:
    """The extension class `attr` of module `module`, or None (`error` says why) where it was
    not built. `fallback_built` logs, once per index, that policy `policy` runs pure Python."""

    def __init__(self, policy: str, module: str, attr: str, cost: str) -> None:
        self.policy, self.module, self.cost = policy, module, cost
        self.warned = False
        self.error: str | None = None
        try:
            self.cls: Any = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            self.cls = None
            self.error = f"{type(exc).__name__}: {exc}"

    def fallback_built(self) -> None:
        """A fallback instance of the registered policy was made: say so the first time."""
        if self.warned:
            return
        self.warned = True
        log.warning("%s: the compiled index %s is not built (%s); using the pure-Python fallback (the same "
                    "decisions, %s). Reinstall kvtier with a C compiler and Python headers present "
                    "(pip install -e .) to build it.", self.policy, self.module, self.error, self.cost)


class FallbackPolicy:
    """Base (first) of a registered policy's pure-Python fallback class. The class registered in
    the extension's place sets `announces_fallback`, so the first instance made under the
    registered name logs that `index` is not built; tests that make the fallback directly do not."""

    index: ClassVar[CompiledIndex]
    announces_fallback: ClassVar[bool] = False
    compiled: ClassVar[bool] = False

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)  # type: ignore[call-arg]  # the policy class after this one
        if type(self).announces_fallback:
            self.index.fallback_built()


class CompiledPolicy:
    """Base (first) of a policy made of a compiled index and `CachePolicy`: its `get` returns
    views, it implements the batch calls, and `CachePolicy.__init__` checks the capacity (the
    index allocated its arrays in `__cinit__`)."""

    returns_views = True
    batch_calls = True
    compiled: ClassVar[bool] = True
    max_blocks: int | None = MAX_INDEX_BLOCKS  # int32 entry numbers (MAX_ENTRIES, kvtier/index/_table.pxd)
    max_key_bytes: int | None = MAX_KEY_BYTES  # a uint16 key length (MAX_KEY, kvtier/index/_table.pxd)

    def __init__(self, cache_capacity: int) -> None:
        from kvtier.policies.base import CachePolicy

        CachePolicy.__init__(self, cache_capacity)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)}/{self.cache_capacity} blocks)"  # type: ignore[arg-type,attr-defined]
