"""The `fingerprint` option of a persistent tier: whose KV its blocks are (see `kvtier.core.limits` for
the identity limit). One check for every backend that takes it (file, valkey), below the tiers so
that a backend's lightest modules (the valkey client's options) may import it."""

from __future__ import annotations

from typing import Any

from kvtier.core.limits import identity_problem
from kvtier.core.quoting import brief


def fingerprint_option(v: Any) -> str:
    """The `fingerprint` option of a persistent backend (`Backend.persistent`): a string of at
    most `kvtier.core.limits.MAX_IDENTITY_BYTES` bytes; `ValueError` saying what is wrong otherwise."""
    if not isinstance(v, str):
        raise ValueError(f"expected a string identifying the model and KV layout, got {type(v).__name__} {brief(v)}")
    problem = identity_problem(v)
    if problem:
        raise ValueError(f"{brief(v)}: {problem}")
    return v


def tier_identity(configured: str, model: str) -> str:
    """The identity recorded by a persistent tier: its configured `fingerprint` and `model`, each
    when given (both when both are: neither can stand in for the other). Empty when neither is."""
    return " | ".join(part for part in (configured, model) if part)
