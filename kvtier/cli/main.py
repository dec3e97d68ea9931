"""The `kvtier` command: `bench` (hops, trace, all), `config check`, `doctor`, `inspect`, `clear`.

User mistakes (a bad config, a missing or malformed trace, an unwritable output path) print one
clear message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from kvtier import __version__
from kvtier.config.problems import count_problems
from kvtier.core.errors import ConfigError, KVTierError

EXIT_USAGE = 2


HOPS, TRACE = "hops", "trace"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# Every `bench` option once: (flags, argparse keywords with the default, the modes it applies to).
# Each is declared on `bench` and on every sub-command it applies to, with default=SUPPRESS there,
# so that it takes effect wherever it is written (`bench --quick trace` == `bench trace --quick`);
# the defaults are filled in after parsing, by `_finish_bench_args`.
BENCH_OPTIONS: list[tuple[tuple[str, ...], dict, frozenset[str]]] = [
    (("--config",), dict(default=None, help="hierarchy YAML (default: the embedded configs/cpu-file.yaml)"),
     frozenset({HOPS, TRACE})),
    (("--json",), dict(default=None, metavar="FILE",
                       help="write the results as JSON (schema kvtier.bench/2, see docs/bench.md)"),
     frozenset({HOPS, TRACE})),
    (("--plot",), dict(default=None, metavar="FILE.png", help="write a PNG plot of the results (needs matplotlib)"),
     frozenset({HOPS, TRACE})),
    (("--quick",), dict(default=False, action="store_true", help="small sizes, for CI and smoke tests"),
     frozenset({HOPS, TRACE})),
    (("--no-progress",), dict(default=False, action="store_true", help="no progress output"), frozenset({HOPS, TRACE})),
    (("--block-sizes",), dict(default=None, metavar="LIST", help="block sizes for hops, e.g. 64KiB,1MiB,8MiB"),
     frozenset({HOPS})),
    (("--root-dir",), dict(default=None, metavar="DIR",
                           help="an existing, writable directory on the filesystem whose file hops to measure "
                             "(default: next to the config's file tier root_dir, else a temporary one)"),
     frozenset({HOPS})),
    (("--trace",), dict(default=None, metavar="FILE",
                        help="Mooncake-format JSONL trace, or 'sample' (a slice of Mooncake's conversation "
                             "trace shipped with kvtier; default: a built-in multi-turn workload)"),
     frozenset({TRACE})),
    (("--workload",), dict(default=None, metavar="NAME",
                           help="generated workload instead of --trace: multiturn (the default), or one with "
                                "sessions: agentic, chat, mixed-scans (docs/bench.md)"), frozenset({TRACE})),
    (("--hints",), dict(default="off", metavar="off|on|both",
                        help="replay kvtier with per-session retention hints (on), without (off, the default) or "
                             "both; needs sessions: --workload agentic|chat|mixed-scans, or a --trace with "
                             "timestamps (sessions inferred)"), frozenset({TRACE})),
    (("--retain-s",), dict(default="auto", metavar="auto|SECONDS",
                           help="the hints' retain_s: auto (the 90th percentile of the gaps between a session's "
                                "turns) or seconds from 1 to 3600"), frozenset({TRACE})),
    (("--limit",), dict(default=None, type=_positive_int, metavar="N", help="replay only the first N requests"),
     frozenset({TRACE})),
    (("--capacities",), dict(default=None, metavar="LIST",
                             help="first-tier capacities in blocks to sweep, e.g. 2k,10k,40k"), frozenset({TRACE})),
    (("--policies",), dict(default=None, metavar="LIST", help="first-tier policies to compare, e.g. lru,arc"),
     frozenset({TRACE})),
    (("--compare",), dict(default=None, choices=["vllm"], help="replay the same trace through vLLM's own manager too"),
     frozenset({TRACE})),
    (("--repeats",), dict(default=None, type=_positive_int, metavar="N",
                          help="rounds of each measurement: hops print their median and spread (default 5, "
                               "--quick 3); trace replays keep the fastest round (default 1)"),
     frozenset({HOPS, TRACE})),
]
BENCH_MODES = {"all": frozenset({HOPS, TRACE}), HOPS: frozenset({HOPS}), TRACE: frozenset({TRACE})}


def _dest(flags: tuple[str, ...]) -> str:
    return flags[0].lstrip("-").replace("-", "_")


def _add_bench_args(p: argparse.ArgumentParser, modes: frozenset[str]) -> None:
    for flags, kwargs, applies in BENCH_OPTIONS:
        if applies & modes:
            p.add_argument(*flags, **{**kwargs, "default": argparse.SUPPRESS})


def _finish_bench_args(args: argparse.Namespace) -> None:
    """Refuse an option written before a sub-command it does not apply to; fill in the defaults."""
    mode = args.bench_command or "all"
    for flags, kwargs, applies in BENCH_OPTIONS:
        if not hasattr(args, _dest(flags)):
            setattr(args, _dest(flags), kwargs["default"])
        elif not applies & BENCH_MODES[mode]:
            raise KVTierError(f"{flags[0]} has no effect on 'bench {mode}'; it applies to: bench "
                              f"{', '.join(m for m, ms in BENCH_MODES.items() if applies & ms)}")


CHECK_HELP = """Validate a YAML hierarchy and print it resolved, or every problem with the path of its field.

A config is trusted input, like code: `backend:` and `policy:` may name any
'package.module:Class', and building the hierarchy imports that module, which runs its code.
`config check` only locates such a module (nothing of it is imported or run) unless
--import-code is given; kvtier's own backends and policies are always checked in full.
Files over 1 MiB, nesting over 32 levels and more than 10,000 values (YAML aliases counted
each time they are used) are refused."""


def build_parser() -> argparse.ArgumentParser:
    """The `kvtier` command line: bench, config check, doctor, inspect, clear, serve."""
    parser = argparse.ArgumentParser(prog="kvtier",
                                     description="Multi-tier KV-cache storage hierarchy for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command")
    _add_bench_parsers(sub)
    _add_config_parsers(sub)
    _add_machine_parsers(sub)
    from kvtier.cli.serve import add_serve_parser

    add_serve_parser(sub)
    return parser


def _add_bench_parsers(sub) -> None:
    """`kvtier bench` and its modes (all, hops, trace)."""
    from kvtier.cli.bench_help import BENCH_EPILOG, HOPS_COLUMNS, TRACE_COLUMNS

    raw = argparse.RawDescriptionHelpFormatter
    bench = sub.add_parser("bench", help="measure a hierarchy: hop bandwidths and a trace replay (default: all)",
                           epilog=BENCH_EPILOG, formatter_class=raw)
    _add_bench_args(bench, BENCH_MODES["all"])
    bench_sub = bench.add_subparsers(dest="bench_command")
    for name, helptext, epilog in (("all", "hops and trace (the default)", BENCH_EPILOG),
                                   (HOPS, "bandwidth of every hop next to same-run baselines", HOPS_COLUMNS),
                                   (TRACE, "replay a request trace through the manager", TRACE_COLUMNS)):
        _add_bench_args(bench_sub.add_parser(name, help=helptext, epilog=epilog, formatter_class=raw),
                        BENCH_MODES[name])


def _add_config_parsers(sub) -> None:
    """`kvtier config check`."""
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command")
    check = config_sub.add_parser("check", help="validate a YAML hierarchy and print it resolved",
                                  description=CHECK_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("file")
    check.add_argument("--block-bytes", help="size of one block, e.g. 2MiB: checked as the config's block_bytes (byte "
                       "capacities resolved into blocks, each at least one block and within its policy's limit)")
    check.add_argument("--import-code", action="store_true",
                       help="also import the modules that backend:/policy: name as 'package.module:Class' and check "
                            "their classes and options (runs their code: only for a config you trust)")
    check.add_argument("--env", action="store_true",
                       help="also check this machine, changing nothing: a valkey tier's password and TLS files, "
                            "then one PING of its server (the cause of a failure is shown), a file tier's "
                            "root_dir, and each local tier's capacity against free memory, /dev/shm and disk "
                            "(exit 2 if a build would fail or a server cannot be used)")

    check.add_argument("--vllm", action="store_true",
                       help="apply the vLLM connector's rules (first tier backend: cpu; tokens and bytes per block, "
                            "the cpu tier's shm_name and the tiers' identity come from the engine: see docs/vllm.md)")


def _add_machine_parsers(sub) -> None:
    """`kvtier doctor`, `kvtier inspect` and `kvtier clear`: this machine and its file tiers."""
    doctor = sub.add_parser("doctor", help="check that kvtier works on this machine (under a minute)",
                            description="One line per check (OK/WARN/FAIL): compiled policy indexes, kvikio, "
                                        "CUDA, /dev/shm, each valkey tier of --config (one PING), and a store -> "
                                        "close -> reopen -> load round trip on a temporary cpu + file hierarchy, "
                                        "bytes compared. Exit status 1 when a check fails.")
    doctor.add_argument("--config", metavar="FILE", help="also reach the valkey tiers of this hierarchy YAML")

    inspect = sub.add_parser("inspect", help="what a file tier holds (read-only), or a running engine's tiers",
                             description="ROOT_DIR: what a file tier holds at rest. --metrics URL instead: a running "
                                         "engine's tiers, read from its Prometheus endpoint (a KVTier's metrics_port "
                                         "or vLLM's /metrics): blocks resident, retained by sessions' hints and of "
                                         "ended sessions per tier, and the retention's counters.")
    inspect.add_argument("root_dir", nargs="?")
    inspect.add_argument("--metrics", metavar="URL", help="a running engine's metrics endpoint instead of ROOT_DIR")
    inspect.add_argument("--verify", action="store_true", help="read every block and check its checksum")
    inspect.add_argument("--json", metavar="FILE", help="also write the report as JSON")

    clear = sub.add_parser("clear", help="remove a file tier's files (only those; refused while the tier is open)",
                           description="Remove the files a file tier keeps in ROOT_DIR (lock, manifest.json, "
                                       "slab.0, journal) and nothing else; the directory is left. Refused for a "
                                       "directory that is no tier, a symlink, a tier open in a live process, "
                                       "and what opening a tier there would refuse (files or a directory not "
                                       "yours or writable by group/others, a symlinked or hard-linked lock). "
                                       "Without --yes, lists what would be removed and removes nothing (exit 2).")
    clear.add_argument("root_dir")
    clear.add_argument("--yes", action="store_true", help="remove them (no question is asked)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            _finish_bench_args(args)
            from kvtier.cli.bench import run_bench

            return run_bench(args)
        if args.command == "config" and args.config_command == "check":
            from kvtier.cli.config_check import run_config_check

            return run_config_check(args)
        if args.command == "doctor":
            from kvtier.cli.doctor import run_doctor

            return run_doctor(args)
        if args.command == "clear":
            from kvtier.cli.clear import run_clear

            return run_clear(args)
        if args.command == "serve":
            from kvtier.cli.serve import run_serve

            return run_serve(args)
        if args.command == "inspect":
            from kvtier.cli.inspect import run_inspect

            return run_inspect(args)
    except ConfigError as exc:
        if exc.source is None:
            print(f"kvtier: error: {exc}", file=sys.stderr)
        else:  # (a config file's problems, as `kvtier config check` lists them)
            print(f"kvtier: error: {exc.source}: {count_problems(exc)} problem(s):", file=sys.stderr)
            for path, message in exc.problems:
                print(f"  {path}: {message}" if path else f"  {message}", file=sys.stderr)
        return EXIT_USAGE
    except KVTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    parser.print_help()
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
