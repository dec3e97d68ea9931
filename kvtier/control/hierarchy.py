"""Build a running hierarchy from a `HierarchyConfig`: its control plane and its worker plane.

The control plane is the `HierarchyManager` over the tiers (backends and policies) with the
router of its tier-to-tier jobs; the worker plane (`kvtier.transfer.planes.WorkerPlane`) runs the jobs that
touch the engine's KV caches. Both front-ends use the two as built here: the standalone `KVTier`
drives both in one process; under vLLM the scheduler builds the hierarchy without KV caches (an
empty worker plane) and each worker builds its own plane over the CPU region it attached
(`build_worker_plane`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

from kvtier.config import HierarchyConfig, TierConfig
from kvtier.config.checks import on_evict_problem
from kvtier.control.manager import SHUTDOWN_TIMEOUT_S, HierarchyManager, Tier
from kvtier.core.errors import ArgumentError, ConfigError
from kvtier.core.identity import tier_identity
from kvtier.core.limits import MAX_IDENTITY_BYTES, identity_problem, tier_blocks_problem
from kvtier.core.quoting import clip
from kvtier.policies.base import CachePolicy, predicts_victims, with_key_index
from kvtier.tiers.base import Backend
from kvtier.tiers.memory import SlotBackend
from kvtier.transfer import registry
from kvtier.transfer.planes import WorkerPlane, build_router, build_worker_plane
from kvtier.transfer.router import Abandoned, TransferRouter

log = logging.getLogger(__name__)

@dataclass
class Hierarchy:
    """A built hierarchy. Control plane: `manager`, and `router`, the router of its tier-to-tier
    jobs. Worker plane: `worker`, the jobs between the KV caches and the tiers (empty when the
    hierarchy was built without KV caches)."""

    config: HierarchyConfig
    manager: HierarchyManager
    router: TransferRouter
    worker: WorkerPlane
    backends: dict[str, Backend] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def first_tier(self) -> Tier:
        """The first tier (every engine store lands there): its name, capacity, counters."""
        return self.manager.tiers[0]

    @property
    def first_backend(self) -> Backend:
        """The backend of the first tier (under vLLM, the shared CPU region)."""
        return self.manager.tiers[0].backend

    def key_limit(self) -> tuple[float, str]:
        """The longest key every tier can hold, its backend and its policy alike (their
        `max_key_bytes`), and what sets it (infinite when none says)."""
        limits = [(b.max_key_bytes, f"tier {name!r}") for name, b in self.backends.items()
                  if b.max_key_bytes is not None]
        limits += [(limit, f"the policy of tier {t.name!r}") for t in self.manager.tiers
                   if (limit := getattr(t.policy, "max_key_bytes", None)) is not None]
        return min(limits, default=(float("inf"), "any tier"))

    def close(self, timeout: float | None = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the worker plane's handlers, then the manager (its jobs finish, every tier closes),
        within `timeout` seconds all together (None: no limit). Copies still running then (a
        read or write hung in the kernel) are abandoned and logged by name: their handlers keep
        their threads and the backends those copies use stay open; everything else closes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = Abandoned()
        try:
            left = self.worker.shutdown(timeout)
            if left.jobs:
                log.error("close abandoned %d engine transfer job(s) still running after %g s: %s. The backends "
                          "of tiers %s are left open.", len(left.jobs), timeout, "; ".join(left.jobs),
                          ", ".join(sorted(left.tiers)) or "(none)")
        finally:
            rest = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.manager.shutdown(rest, keep_open=left.tiers)

    def __enter__(self) -> Hierarchy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tier_blocks(config: HierarchyConfig, block_bytes: int | None) -> list[int]:
    """Capacity of each tier in blocks; raises ConfigError naming the tier that holds no block."""
    counts = []
    for i, tier in enumerate(config.tiers):
        if tier.capacity.blocks is None and not block_bytes:
            raise ConfigError([(f"tiers[{i}].capacity", f"{tier.capacity} is a size, and the size of a block is not "
                                                        "known: set block_bytes in the config, or give the capacity "
                                                        "in blocks (e.g. '1000 blocks')")])
        n = tier.capacity.to_blocks(block_bytes)
        if n < 1:
            raise ConfigError([(f"tiers[{i}].capacity", f"{tier.capacity} holds no block of {block_bytes} bytes")])
        counts.append(n)
    return counts


def build_hierarchy(config: HierarchyConfig, *, block_bytes: int | None = None, kv_caches: Any = None,
                    dry_run: bool = False, enable_events: bool = False, model: str = "") -> Hierarchy:
    """Create every tier of `config`, the manager over them with the handlers for the hops between
    tiers (control plane), and the handlers between the KV caches and the tiers (worker plane).

    `block_bytes` (bytes per block) overrides the config's; it is required when a capacity is a
    byte size. `kv_caches` (`CanonicalKVCaches`) fills the worker plane; without it the plane is
    empty (vLLM's scheduler: its workers build their own). A tier the worker plane loads straight
    into the KV caches is served directly, others by promotion into the first tier. With
    `dry_run`, backends only track slots and every transfer completes at once without bytes
    (trace replay of the control plane). A failed build closes what it had opened.

    `model` names the model whose KV the hierarchy holds (e.g. `"meta-llama/Llama-3.1-8B@<rev>"`).
    A persistent tier (`Backend.persistent`, e.g. `file`) is built with `fingerprint` = its
    configured `fingerprint` and `model` (see `tier_identity`; at least one must be given, else
    `ConfigError` naming `tiers[i].fingerprint`) and `layout` = the block geometry and, with
    `kv_caches`, each tensor's dtype and shape (see `describe_layout`). `model` longer than
    `kvtier.core.limits.MAX_IDENTITY_BYTES` is an `ArgumentError` naming `model`, before anything is
    built; so is a persistent tier's identity (fingerprint and model) past it, naming
    `tiers[i].fingerprint`.
    """
    _check_model(model)  # before anything is allocated
    block_bytes = block_bytes or config.block_bytes
    layout = describe_layout(block_bytes or 0, config.block_tokens, kv_caches)
    backends: dict[str, Backend] = {}
    policies: list[CachePolicy] = []
    router: TransferRouter | None = None
    worker: WorkerPlane | None = None
    try:
        for i, (tier_cfg, n) in enumerate(zip(config.tiers, tier_blocks(config, block_bytes))):
            backends[tier_cfg.name], policy = _build_tier(i, config, n, block_bytes or 0, dry_run, model, layout)
            policies.append(policy)
        router = build_router(backends, kv_side=False, dry_run=dry_run)
        worker = build_worker_plane(backends, kv_caches, dry_run=dry_run)
        # A tier whose blocks the worker plane loads straight into the KV caches is served
        # directly, without a promotion into the first tier (see `HierarchyManager.lookup`).
        tiers = [Tier(tier_cfg.name, backend, policy, tier_cfg.cascade, tier_cfg.reserve,
                      direct_load=worker.loads_from(backend.spec_type))
                 for tier_cfg, backend, policy in zip(config.tiers, backends.values(), policies)]
        manager = HierarchyManager(tiers, router, enable_events=enable_events)
    except BaseException:
        for plane in (worker, router):
            if plane is not None:
                plane.shutdown()
        for backend in backends.values():
            backend.close()
        raise
    return Hierarchy(config, manager, router, worker, backends, dry_run)


def _check_model(model: Any) -> None:
    """`TypeError` unless `model` is a string, `ArgumentError` naming it past `MAX_IDENTITY_BYTES`."""
    if not isinstance(model, str):
        raise TypeError(f"model must be a string naming the model whose KV this is, got {type(model).__name__}")
    problem = identity_problem(model)
    if problem:
        raise ArgumentError(f"model: {problem}")


def _build_tier(i: int, config: HierarchyConfig, n: int, block_bytes: int, dry_run: bool, model: str,
                layout: str) -> tuple[Backend, CachePolicy]:
    """The backend (`n` blocks) and policy of `config.tiers[i]`; `ConfigError` on a capacity it
    cannot hold or an `on_evict` cascade over a policy that does not predict its victims."""
    tier_cfg = config.tiers[i]
    # load_class checked that it derives from the kind's base (Backend)
    cls = cast("type[Backend]", registry.load_class(registry.BACKEND, tier_cfg.backend, f"tiers[{i}].backend"))
    assert tier_cfg.policy is not None, "HierarchyConfig fills in every tier's policy"
    policy_cls = registry.load_class(registry.POLICY, tier_cfg.policy, f"tiers[{i}].policy")
    _check_capacity(i, tier_cfg, n, cls, policy_cls, 0 if dry_run else block_bytes)
    try:
        built = policy_cls(n)
    except Exception as exc:  # whatever the class's own __init__ raises
        raise ConfigError([(f"tiers[{i}].policy", f"policy {tier_cfg.policy!r}: {policy_cls.__qualname__}({n}) "
                                                  f"raised {type(exc).__name__}: {clip(str(exc))}")]) from exc
    policy = with_key_index(built)
    if tier_cfg.cascade == "on_evict" and i + 1 < len(config.tiers) and not predicts_victims(policy):
        raise ConfigError([on_evict_problem(i, tier_cfg.policy)])
    if dry_run:
        return SlotBackend(tier_cfg.name, n, block_bytes, config.block_tokens, cls.spec_type), policy
    options = backend_options(config, i, layout, model, persistent=cls.persistent)
    return _build_backend(cls, i, tier_cfg.name, n, block_bytes, config.block_tokens, options), policy


def backend_options(config: HierarchyConfig, i: int, layout: str, model: str = "", persistent: bool = True) -> dict:
    """The options `config.tiers[i]`'s backend is built with: the YAML's and, for a `persistent`
    tier, the identity it records (`fingerprint`: see `tier_identity`; `layout`: `describe_layout`).
    A process that reads such a tier without owning it (a vLLM worker: `kvtier.tiers.file.reader`)
    derives the manifest it expects from these, as the owner does."""
    options = dict(config.tiers[i].options)
    if persistent:
        options.update(fingerprint=_persistent_identity(i, config.tiers[i], model), layout=layout)
    return options


def _check_capacity(i: int, tier_cfg: TierConfig, n: int, cls: type[Backend], policy_cls: type,
                    block_bytes: int) -> None:
    """`n` blocks are what tiers[i]'s backend and policy can hold (`kvtier.core.limits`, as `config
    check` checks them) and, with `block_bytes` (0: not checked), fit this machine; else a
    `ConfigError` on `tiers[i].capacity`, before anything is allocated."""
    problem = tier_blocks_problem(n, cls, policy_cls, backend_name=tier_cfg.backend, policy_name=tier_cfg.policy or "")
    if not problem and block_bytes:
        problem = cls.capacity_problem(n * block_bytes, dict(tier_cfg.options))
    if problem:
        raise ConfigError([(f"tiers[{i}].capacity", problem)])


def _build_backend(cls, i: int, name: str, n: int, block_bytes: int, block_tokens: int, options: dict) -> Backend:
    """`cls.from_config`; a `ConfigError` on one of its options gets the tier's path (`tiers[i].`)."""
    try:
        return cls.from_config(name, n, block_bytes, block_tokens, options)
    except ConfigError as exc:
        raise ConfigError([(f"tiers[{i}].{field}" if field else f"tiers[{i}]", message)
                           for field, message in exc.problems]) from exc.__cause__


def _persistent_identity(i: int, tier_cfg: Any, model: str) -> str:
    """The identity of persistent tier `i`; `ConfigError` naming `tiers[i].fingerprint` if empty."""
    configured = str(tier_cfg.options.get("fingerprint") or "")
    identity = tier_identity(configured, model)
    problem = identity_problem(identity)
    if problem:
        raise ConfigError([(f"tiers[{i}].fingerprint",
                            f"the identity tier {tier_cfg.name!r} records, this fingerprint ({len(configured)} "
                            f"characters) and the model ({len(model)} characters) joined by ' | ', is {problem}")])
    if not identity:
        raise ConfigError([(f"tiers[{i}].fingerprint",
                            f"empty, and no model was given: tier {tier_cfg.name!r} keeps blocks across restarts "
                            f"and must not serve them to another model; pass model='<model name>@<revision>' "
                            f"(KVTier.open, build_hierarchy) or set this field to the identity of the model whose "
                            f"KV the tier holds (under vLLM it is derived from the served model)")])
    return identity


def describe_layout(block_bytes: int, block_tokens: int, kv_caches: Any = None) -> str:
    """What decides the bytes of a block besides the model: the block geometry and, when the KV
    caches are known, each tensor's dtype, shape past the block dimension and page size, and how
    each KV group's references pack them into a block. Deterministic and human-readable (runs of
    identical tensors are counted, consecutive references merged), so a mismatch can be logged;
    past `MAX_IDENTITY_BYTES` it is cut there, ending with the length and a digest of the whole."""
    text = f"block_bytes={block_bytes} block_tokens={block_tokens}"
    if kv_caches is None:
        return text
    tensors = [f"{getattr(t.tensor, 'dtype', '?')}{list(t.tensor.shape)[1:]}/{t.page_size_bytes}"
               for t in kv_caches.tensors]
    groups = ["+".join(_ref_runs(refs)) for refs in kv_caches.group_data_refs]
    text = (f"{text} blocks_per_chunk={getattr(kv_caches, 'blocks_per_chunk', 1)} "
            f"tensors={','.join(_counted(tensors))} groups={';'.join(groups) or '-'}")
    if len(text) <= MAX_IDENTITY_BYTES:  # (ASCII: dtypes, numbers and punctuation)
        return text
    digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    tail = f"... ({len(text)} characters, blake2b {digest})"
    return text[:MAX_IDENTITY_BYTES - len(tail)] + tail


def _counted(items: list[str]) -> list[str]:
    """Consecutive equal items as `"N*item"` (or `item` alone)."""
    out: list[tuple[int, str]] = []
    for item in items:
        if out and out[-1][1] == item:
            out[-1] = (out[-1][0] + 1, item)
        else:
            out.append((1, item))
    return [f"{n}*{item}" if n > 1 else item for n, item in out]


def _ref_runs(refs: list[Any]) -> list[str]:
    """References `(tensor_idx, page)` as `"first-last/page"` runs of consecutive tensors."""
    runs: list[list[int]] = []  # [first, last, page]
    for ref in refs:
        if runs and ref.tensor_idx == runs[-1][1] + 1 and ref.page_size_bytes == runs[-1][2]:
            runs[-1][1] = ref.tensor_idx
        else:
            runs.append([ref.tensor_idx, ref.tensor_idx, ref.page_size_bytes])
    return [f"{a}-{b}/{page}" if a != b else f"{a}/{page}" for a, b, page in runs]
