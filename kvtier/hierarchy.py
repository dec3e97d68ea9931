"""Build a running hierarchy (backends, policies, router, manager) from a `HierarchyConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier import registry, specs
from kvtier.capacity import capacity_problem
from kvtier.config import HierarchyConfig
from kvtier.engine import TransferEngine
from kvtier.errors import ConfigError
from kvtier.handlers.base import ImmediateHandler
from kvtier.manager import HierarchyManager, Tier
from kvtier.tiers.base import Backend
from kvtier.tiers.memory import SlotBackend


@dataclass
class Hierarchy:
    """A built hierarchy: `manager` is the control plane, `engine` routes byte movement."""

    config: HierarchyConfig
    manager: HierarchyManager
    engine: TransferEngine
    backends: dict[str, Backend] = field(default_factory=dict)
    dry_run: bool = False

    def close(self) -> None:
        self.manager.shutdown()

    def __enter__(self) -> "Hierarchy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tier_blocks(config: HierarchyConfig, block_bytes: int | None) -> list[int]:
    """Capacity of each tier in blocks; raises ConfigError naming the tier that holds no block."""
    counts = []
    for i, tier in enumerate(config.tiers):
        n = tier.capacity.to_blocks(block_bytes)
        if n < 1:
            raise ConfigError([(f"tiers[{i}].capacity", f"{tier.capacity} holds no block of {block_bytes} bytes")])
        counts.append(n)
    return counts


def build_hierarchy(config: HierarchyConfig, *, block_bytes: int | None = None, kv_caches: Any = None,
                    dry_run: bool = False, enable_events: bool = False) -> Hierarchy:
    """Create every tier of `config` and the handlers for the hops between them.

    `block_bytes` (bytes per block) overrides the config's; it is required when a capacity is a
    byte size. `kv_caches` (`CanonicalKVCaches`) enables the handlers that touch the engine's KV
    cache. With `dry_run`, backends only track slots and every transfer completes at once without
    bytes (trace replay of the control plane).
    """
    block_bytes = block_bytes or config.block_bytes
    backends: dict[str, Backend] = {}
    tiers: list[Tier] = []
    try:
        for i, (tier_cfg, n) in enumerate(zip(config.tiers, tier_blocks(config, block_bytes))):
            cls = registry.load_class(registry.BACKEND, tier_cfg.backend, f"tiers[{i}].backend")
            if not dry_run and block_bytes:
                problem = capacity_problem(tier_cfg.backend, cls.medium, n * block_bytes, dict(tier_cfg.options))
                if problem:
                    raise ConfigError([(f"tiers[{i}].capacity", problem)])
            if dry_run:
                backend: Backend = SlotBackend(tier_cfg.name, n, block_bytes or 0, config.block_tokens, cls.spec_type)
            else:
                backend = cls.from_config(tier_cfg.name, n, block_bytes or 0, config.block_tokens, dict(tier_cfg.options))
            backends[tier_cfg.name] = backend
            policy = registry.load_class(registry.POLICY, tier_cfg.policy, f"tiers[{i}].policy")(n)
            tiers.append(Tier(tier_cfg.name, backend, policy, tier_cfg.cascade, tier_cfg.reserve))
        engine = _build_engine(backends, kv_caches, dry_run)
    except BaseException:
        for backend in backends.values():
            backend.close()
        raise
    manager = HierarchyManager(tiers, engine, enable_events=enable_events)
    return Hierarchy(config, manager, engine, backends, dry_run)


def _build_engine(backends: dict[str, Backend], kv_caches: Any, dry_run: bool) -> TransferEngine:
    engine = TransferEngine()
    present = {b.spec_type.__name__ for b in backends.values()}
    if kv_caches is not None:
        present.add("GPULoadStoreSpec")
    for (src, dst), factory_path in registry.HANDLERS.items():
        if src not in present or dst not in present:
            continue
        if dry_run:
            handler = ImmediateHandler()
        else:
            handler = registry.load_object(factory_path)(backends, kv_caches)
        if handler is not None:
            engine.register(getattr(specs, src), getattr(specs, dst), handler)
    return engine
