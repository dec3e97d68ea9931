"""Conformance suites for third-party implementations (kvtier's own test fixtures live in tests/support).

Subclass a suite in your own pytest file; pytest collects and runs its tests::

    from kvtier.testing import PolicyTests

    class TestMyPolicy(PolicyTests):
        policy_factory = MyPolicy

- `PolicyTests` (a `CachePolicy`), `BackendTests` (a `Backend`: implement `make_backend`),
  `HandlerTests` (one `(src, dst)` hop: implement `make_sides`), `ManagerTests` (an
  `OffloadingManager`, driven as vLLM's scheduler drives it: implement `make_manager`).

A failing `PolicyTests` or `BackendTests` check says which clause of the contract was broken; the
clauses are sentences in `kvtier.testing.policy_contract` and `kvtier.testing.backend_contract`.

`kvtier.testing.fake_remote` is a fake Valkey/Redis `RemoteStore` (a dict, failure injection)
for testing code on a `valkey` tier without a server.

The suites need pytest (and hypothesis for `PolicyTests`), so they are imported on first use:
`import kvtier.testing` alone imports neither.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PolicyTests": "kvtier.testing.policy",
    "BackendTests": "kvtier.testing.backend",
    "HandlerTests": "kvtier.testing.handler",
    "Side": "kvtier.testing.handler",
    "HostSlotSide": "kvtier.testing.handler",
    "FileSlotSide": "kvtier.testing.handler",
    "RemoteSlotSide": "kvtier.testing.handler",
    "EngineSide": "kvtier.testing.handler",
    "JobCollector": "kvtier.testing.handler",
    "ManagerTests": "kvtier.testing.manager",
    "SchedulerDriver": "kvtier.testing.scheduler_driver",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
