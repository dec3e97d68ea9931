"""Loading a compiled policy index (kvtier/policies/_compact_*.pyx), and the one log line that
says when a registered policy runs its pure-Python fallback instead."""

from __future__ import annotations

import importlib
import logging
from typing import Any

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
