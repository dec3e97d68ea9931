"""`kvtier config check FILE`: the resolved hierarchy, or every error with its field path."""

from __future__ import annotations

import sys

from kvtier.config import format_size, load_config, parse_size
from kvtier.errors import ConfigError


def describe(config, block_bytes: int | None = None) -> str:
    """A human-readable summary of a resolved hierarchy."""
    block_bytes = block_bytes or config.block_bytes
    lines = [f"hierarchy from {config.source}: {len(config.tiers)} tier(s), {config.block_tokens} tokens per block"
             + (f", {format_size(block_bytes)} per block" if block_bytes else "")]
    for i, tier in enumerate(config.tiers):
        blocks = ""
        if tier.capacity.blocks is not None:
            blocks = f" = {tier.capacity.blocks} blocks"
        elif block_bytes:
            blocks = f" = {tier.capacity.bytes // block_bytes} blocks"
        arrow = ""
        if i + 1 < len(config.tiers):
            arrow = f"  -> cascade {tier.cascade} to {config.tiers[i + 1].name}"
        opts = "".join(f", {k}={v}" for k, v in tier.options.items())
        lines.append(f"  [{i}] {tier.name}: backend={tier.backend}, capacity={tier.capacity}{blocks}, "
                     f"policy={tier.policy}, reserve={tier.reserve:g}{opts}{arrow}")
    return "\n".join(lines)


def run_config_check(args) -> int:
    try:
        block_bytes = parse_size(args.block_bytes) if args.block_bytes else None
    except ValueError as exc:
        raise ConfigError([("--block-bytes", str(exc))]) from None
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(f"{args.file}: {len(exc.problems)} problem(s):", file=sys.stderr)
        for path, message in exc.problems:
            print(f"  {path}: {message}" if path else f"  {message}", file=sys.stderr)
        return 2
    print(describe(config, block_bytes))
    return 0
