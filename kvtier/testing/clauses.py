"""How the conformance suites report a broken contract clause (no test framework needed).

Each suite's clauses are sentences in its `*_contract` module; a failing check's message starts
with the clause it enforces. `call` does the same for a call that raises where the contract
allows no exception, so the implementer sees the rule, not only their own traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def call(clause: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, with an exception it raises reported as a failure of `clause` (`what`: the call
    as the message shows it)."""
    try:
        return fn(*args)
    except Exception as exc:  # any exception: the contract allows none here
        raise AssertionError(f"{clause}: {what} raised {type(exc).__name__}: {exc}") from exc
