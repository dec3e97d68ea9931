"""`kvtier config check FILE`: the resolved hierarchy, or every error with its field path.

Nothing named by the config is imported unless `--import-code` is given: a "package.module:Class"
in `backend:` or `policy:` is only located (`registry.check_name`), since importing it runs its code.

`--env` also checks this machine, changing nothing: what each tier's backend reads when it is built
(`Backend.check_environment`: the valkey tier's password variable or file and TLS files and one PING
of its server, the file tier's `root_dir`) and whether each local tier's capacity fits the room the
build checks (`Backend.capacity_problem`), so that a config checked on the serving host is
one that starts and works there.
"""

from __future__ import annotations

import sys

from kvtier.config import format_size, is_external, load_config, load_raw_config_file, parse_config, parse_size
from kvtier.config.input import brief
from kvtier.config.problems import count_problems
from kvtier.core.errors import ConfigError
from kvtier.transfer import registry


def describe(config, block_bytes: int | None = None) -> str:
    """A human-readable summary of a resolved hierarchy: one line per tier with what applies to it
    (a reserve only where an `on_evict` cascade uses it, no cascade or reserve for a shared tier)."""
    block_bytes = block_bytes or config.block_bytes
    lines = [f"hierarchy from {config.source}: {len(config.tiers)} tier(s), {config.block_tokens} tokens per block"
             + (f", {format_size(block_bytes)} per block" if block_bytes else "")]
    if config.shared is not None:
        lines.append(f"  shared by the engines of this host: the tiers are the owner's at {config.shared.socket} "
                     f"(kvtier serve), each call bounded by timeout_ms={config.shared.timeout_ms}")
    for i, tier in enumerate(config.tiers):
        capacity = f"capacity={tier.capacity}"
        if tier.capacity.blocks is None and block_bytes:
            capacity += f" = {tier.capacity.bytes // block_bytes} blocks"
        below = config.tiers[i + 1] if i + 1 < len(config.tiers) and not _shared(config.tiers[i + 1].backend) else None
        if _shared(tier.backend):
            fields = [f"{capacity} (handles of keys on the server)", f"policy={tier.policy} (which handles to forget)"]
            arrow = f"  (shared: publishes {config.tiers[0].name}'s stores, promotes into it)"
        else:
            fields = [capacity, f"policy={tier.policy}"]
            arrow = f"  -> cascade {tier.cascade} to {below.name}" if below is not None else ""
            if below is not None and tier.cascade == "on_evict":
                fields.append(f"reserve={tier.reserve:g}")
        fields += [f"{k}={_show(v)}" for k, v in tier.options.items() if v is not None]
        lines.append(f"  [{i}] {tier.name}: backend={tier.backend}, " + ", ".join(fields) + arrow)
    return "\n".join(lines)


def _shared(backend: str) -> bool:
    """Whether a registered backend is a shared tier (external ones are not imported here)."""
    return backend in registry.BACKENDS and bool(getattr(registry.resolve(registry.BACKENDS, backend), "shared", False))


def _show(value) -> str:
    return value if isinstance(value, str) and len(value) <= 200 and value.isprintable() else brief(value)


def not_imported(config) -> list[str]:
    """Notes on the "package.module:Class" names that were located but not imported."""
    notes = []
    for i, tier in enumerate(config.tiers):
        for kind, field, name, checked in ((registry.BACKEND, "backend", tier.backend, "its class and options are"),
                                           (registry.POLICY, "policy", tier.policy, "its class is")):
            if is_external(kind, name):
                notes.append(f"note: tiers[{i}].{field}: module of {name!r} found but not imported (nothing of it "
                             f"ran); {checked} checked when the hierarchy is built, or with --import-code")
    return notes


def run_config_check(args) -> int:
    try:
        block_bytes = parse_size(args.block_bytes) if args.block_bytes else None
    except ValueError as exc:
        raise ConfigError([("--block-bytes", str(exc))]) from None
    notes: list[str] = []
    try:
        if args.vllm:
            from kvtier.cli.vllm_check import load_for_vllm

            config, notes = load_for_vllm(args.file, args.import_code)
        if block_bytes:  # (checked as the config's own block_bytes: capacities in blocks, the policy's limit)
            raw = load_raw_config_file(args.file)
            if isinstance(raw, dict):
                raw = {**raw, "block_bytes": args.block_bytes}
            checked = parse_config(raw, str(args.file), import_code=args.import_code)
            config = config if args.vllm else checked
        elif not args.vllm:
            config = load_config(args.file, import_code=args.import_code)
    except ConfigError as exc:
        print(f"{args.file}: {count_problems(exc)} problem(s):", file=sys.stderr)
        for path, message in exc.problems:
            print(f"  {path}: {message}" if path else f"  {message}", file=sys.stderr)
        return 2
    print(describe(config, block_bytes))
    for note in notes:
        print(note)
    if not args.import_code:
        for note in not_imported(config):
            print(note)
    return check_environment(config, args, block_bytes) if args.env else 0


def check_environment(config, args, block_bytes: int | None = None) -> int:
    """`--env`: each tier's `Backend.check_environment` on this machine and whether its capacity
    fits (the build's own `capacity_problem`); 2 when one has problems."""
    print("on this machine:")
    block_bytes = block_bytes or config.block_bytes
    problems = []
    for i, tier in enumerate(config.tiers):
        if is_external(registry.BACKEND, tier.backend) and not args.import_code:
            print(f"  tiers[{i}] {tier.name}: backend {tier.backend!r} not imported: not checked (--import-code)")
            continue
        cls = registry.resolve(registry.BACKENDS, tier.backend)
        check = getattr(cls, "check_environment", None)
        notes, found = check(tier.options) if check is not None else ([], [])
        found = [(f"tiers[{i}].{field}", message) for field, message in found]
        note, problem = _capacity_fits(tier, cls, block_bytes)
        notes += [note] if note else []
        notes += [_engine_file_path(tier.options)] if cls.medium == "FILE" else []
        notes += [_engine_cpu_path(tier.options)] if cls.medium == "CPU" else []
        found += [(f"tiers[{i}].capacity", problem)] if problem else []
        problems += found
        said = ([f"{len(found)} problem(s)"] if found else []) + notes  # (a tier with problems says so first)
        print(f"  tiers[{i}] {tier.name}: " + ("; ".join(said) or "nothing to check"))
    if problems:
        print(f"{args.file}: {len(problems)} problem(s) on this machine:", file=sys.stderr)
        for path, message in problems:
            print(f"  {path}: {message}", file=sys.stderr)
        return 2
    return 0


def _engine_file_path(options) -> str:
    """Which path the engine's KV cache takes to and from this file tier here, and why."""
    from kvtier.transfer.handlers.file_path import file_path

    choice, why = file_path(str(options.get("io", "auto")))
    return f"engine<->file {choice} ({why})"


def _engine_cpu_path(options) -> str:
    """Which copy mechanism the engine's KV cache takes to and from this CPU tier here (measured)."""
    from kvtier.transfer.handlers.fast_path import engine_cpu_note

    return engine_cpu_note(options)


def _capacity_fits(tier, cls, block_bytes: int | None) -> tuple[str, str | None]:
    """(note, problem) of comparing a tier's capacity with this machine's room, as the build does:
    `n * block_bytes` bytes with n the capacity in blocks (a byte capacity when the block size is
    unknown; a count of blocks then cannot be compared)."""
    if getattr(cls, "shared", False) or cls.medium not in ("CPU", "FILE"):
        return "", None
    if tier.capacity.blocks is not None and not block_bytes:
        return f"capacity {tier.capacity} not compared with free space (give --block-bytes)", None
    need = tier.capacity.to_blocks(block_bytes) * block_bytes if block_bytes else tier.capacity.bytes
    problem = cls.capacity_problem(need, dict(tier.options))
    return ("", problem) if problem else (f"capacity {format_size(need)} fits", None)
