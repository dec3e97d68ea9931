"""The checks of a parsed config that look at a tier's neighbours or at its classes: block counts
against what the backend and policy can hold, a handler for every hop, where a shared tier may
stand. Each records what it finds in a `Problems`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.config.problems import Problems
from kvtier.core.limits import tier_blocks_problem
from kvtier.core.specs import GPULoadStoreSpec
from kvtier.policies.base import class_predicts_victims
from kvtier.transfer import registry

if TYPE_CHECKING:
    from kvtier.config import TierConfig


def check_blocks(i: int, tier: TierConfig, backend_cls, policy_cls, default_policy: str, block_bytes: int | None,
                 problems: Problems) -> None:
    """tiers[i]'s block count against what its backend and policy can hold (`kvtier.core.limits`, as
    the build checks it); a capacity in bytes is counted only when the config gives block_bytes."""
    blocks = tier.capacity.blocks
    if blocks is None and block_bytes and tier.capacity.bytes is not None:
        blocks = tier.capacity.bytes // block_bytes
    if not blocks:  # unknown, or a size smaller than a block (reported below)
        return
    policy = tier.policy or default_policy
    problem = tier_blocks_problem(blocks, backend_cls, policy_cls, backend_name=tier.backend, policy_name=policy)
    if problem:
        problems.add(f"tiers[{i}].capacity", problem)


def on_evict_problem(i: int, policy: str) -> tuple[str, str]:
    """The problem of tiers[i] cascading `on_evict` over `policy`, which does not predict its victims."""
    return (f"tiers[{i}].cascade", f"'on_evict' copies blocks down before they are evicted, which needs a policy "
                                   f"that predicts its victims (`victims`); {policy!r} does not, so every eviction "
                                   f"would be lost: use cascade: on_store, or implement victims(n, skip)")


def check_cascade(i: int, tier: TierConfig, policy_cls, default_policy: str, has_below: bool,
                  problems: Problems) -> None:
    """tiers[i] cascading `on_evict` to a tier below needs a policy class that predicts its
    victims (as the build checks it); a class not imported (None) is not checked."""
    if has_below and tier.cascade == "on_evict" and policy_cls is not None and not class_predicts_victims(policy_cls):
        problems.add(*on_evict_problem(i, tier.policy or default_policy))


def check_chain_end(raw_tiers: list, read: list[dict[str, Any]], classes: list, problems: Problems) -> None:
    """Refuse a `cascade` (on_evict, on_store) or a `reserve` above 0 given on a tier with no tier
    below it in the cascade chain: the last local tier, and a shared tier (`Backend.shared`: fed by
    publishing, outside the chain). Either would have no effect. `read` (each tier's valid fields)
    and `classes` line up with `raw_tiers` (None where unknown: an external backend not imported
    counts as local); a value given and invalid is reported as such, not here (`cascade: none`
    and `reserve: 0` say what happens there: accepted)."""
    shared = [bool(getattr(c, "shared", False)) for c in classes]
    for i, (raw, fields) in enumerate(zip(raw_tiers, read)):
        if not fields or any(not s for s in shared[i + 1:]):
            continue
        name = repr(fields["name"]) if "name" in fields else f"tiers[{i}]"
        if shared[i]:
            where = f"shared tier {name}, outside the cascade chain (fed by publishing tier 0's stores)"
            fix = "remove it"
        else:
            after = [repr(f.get("name", "")) for f, s in zip(read[i + 1:], shared[i + 1:]) if s]
            where = f"{name}, the last tier of the cascade chain" + (
                f" (shared tier {after[0]} after it is fed by publishing)" if after else "")
            fix = "remove it ({}), or add a tier below it"
        cascade, reserve = fields.get("cascade", "none"), fields.get("reserve", 0)
        if raw.get("cascade") is not None and cascade != "none":
            problems.add(f"tiers[{i}].cascade", f"cascade: {cascade} has no effect on {where}: there is no "
                         "tier below it to copy blocks to", f"; {fix.format('or write cascade: none')}")
        if raw.get("reserve") is not None and reserve > 0:
            problems.add(f"tiers[{i}].reserve", f"reserve: {reserve:g} has no effect on {where}: a reserve "
                         "is kept free by copying blocks to the tier below, and there is none",
                         f"; {fix.format('or write reserve: 0')}")


def check_handlers(tiers: list[TierConfig], classes: list, problems: Problems) -> None:
    """Every hop the hierarchy will use must have a registered handler."""
    if any(c is None for c in classes):
        return
    specs = [c.spec_type for c in classes]  # (types, not names: two kinds may name their specs alike)
    check_shared(tiers, classes, problems)
    for i in range(len(tiers) - 1):
        upper, lower = specs[i], specs[i + 1]
        shared_below = getattr(classes[i + 1], "shared", False)  # fed by publishing, not by the cascade
        if tiers[i].cascade != "none" and not shared_below and not registry.has_handler(upper, lower):
            problems.add(f"tiers[{i}].cascade", f"no handler moves blocks from {tiers[i].backend!r} "
                         f"({upper.__name__}) to {tiers[i + 1].backend!r} ({lower.__name__}); set cascade: none "
                         "or change the backends")
        if not (registry.has_handler(lower, specs[0]) or registry.has_handler(lower, GPULoadStoreSpec)):
            problems.add(f"tiers[{i + 1}].backend", f"blocks in {tiers[i + 1].backend!r} could never be loaded: no "
                         f"handler from {lower.__name__} to {specs[0].__name__} or to the engine's KV cache")


def check_shared(tiers: list[TierConfig], classes: list, problems: Problems) -> None:
    """A shared tier (`Backend.shared`, e.g. valkey) comes after every local tier, at most one of
    them, and the first tier is then a host-memory (CPU) tier: it publishes from there and
    promotes into there."""
    shared = [i for i, c in enumerate(classes) if getattr(c, "shared", False)]
    if not shared:
        return
    for i in shared[1:]:
        problems.add(f"tiers[{i}].backend", f"a second shared tier ({tiers[shared[0]].name!r} is one); a "
                     f"hierarchy has at most one")
    local = [i for i, c in enumerate(classes) if not getattr(c, "shared", False)]
    if not local:
        problems.add(f"tiers[{shared[0]}].backend", f"{tiers[shared[0]].backend!r} is a shared tier; it needs a "
                     f"host-memory first tier (backend: cpu or memory) before it")
        return
    if local[-1] > shared[0]:
        problems.add(f"tiers[{shared[0]}].backend", f"shared tier {tiers[shared[0]].name!r} must come after every "
                     f"local tier (tiers[{local[-1]}] {tiers[local[-1]].name!r} is after it); move it last")
    if classes[0].medium != "CPU":
        problems.add("tiers[0].backend", f"with a shared tier ({tiers[shared[0]].name!r}) the first tier must be a "
                     f"host-memory tier (backend: cpu or memory), got {tiers[0].backend!r}")
