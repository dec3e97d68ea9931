"""The `fingerprint` option of a persistent tier: whose KV its blocks are (see `kvtier.limits` for
the identity limit). One check for every backend that takes it (file, valkey), below the tiers so
that a backend's lightest modules (the valkey client's options) may import it."""

from __future__ import annotations

from typing import Any

from kvtier.limits import identity_problem
from kvtier.quoting import brief


def fingerprint_option(v: Any) -> str:
    """The `fingerprint` option of a persistent backend (`Backend.persistent`): a string of at
    most `kvtier.limits.MAX_IDENTITY_BYTES` bytes; `ValueError` saying what is wrong otherwise."""
    if not isinstance(v, str):
        raise ValueError(f"expected a string identifying the model and KV layout, got {type(v).__name__} {brief(v)}")
    problem = identity_problem(v)
    if problem:
        raise ValueError(f"{brief(v)}: {problem}")
    return v
