"""The `kvtier` command: `bench` (hops, trace, all), `config check`, `inspect`.

User mistakes (a bad config, a missing or malformed trace, an unwritable output path) print one
clear message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from kvtier.errors import KVTierError

EXIT_USAGE = 2


def _add_bench_args(p: argparse.ArgumentParser, *, trace: bool, hops: bool) -> None:
    p.add_argument("--config", help="hierarchy YAML (default: the embedded configs/cpu-file.yaml)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (schema kvtier.bench/1, see docs/bench.md)")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG plot of the results (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="small sizes, for CI and smoke tests")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    if hops:
        p.add_argument("--block-sizes", metavar="LIST", help="block sizes for hops, e.g. 64KiB,1MiB,8MiB")
        p.add_argument("--root-dir", metavar="DIR", help="directory for the file-tier measurements (default: a temporary one)")
    if trace:
        p.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace (default: a built-in multi-turn workload)")
        p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
        p.add_argument("--capacities", metavar="LIST", help="first-tier capacities in blocks to sweep, e.g. 2k,10k,40k")
        p.add_argument("--policies", metavar="LIST", help="first-tier policies to compare, e.g. lru,arc")
        p.add_argument("--compare", choices=["vllm"], help="replay the same trace through vLLM's own manager too")
        p.add_argument("--repeats", type=int, default=1, metavar="N",
                       help="interleaved rounds per run, keeping the fastest (steadier ops/s on a busy machine)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Multi-tier KV-cache storage hierarchy for LLM inference.")
    sub = parser.add_subparsers(dest="command")

    bench = sub.add_parser("bench", help="measure a hierarchy: hop bandwidths and a trace replay (default: all)")
    _add_bench_args(bench, trace=True, hops=True)
    bench_sub = bench.add_subparsers(dest="bench_command")
    for name, helptext, t, h in (("all", "hops and trace (the default)", True, True),
                                 ("hops", "bandwidth of every hop next to same-run baselines", False, True),
                                 ("trace", "replay a request trace through the manager", True, False)):
        _add_bench_args(bench_sub.add_parser(name, help=helptext), trace=t, hops=h)

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command")
    check = config_sub.add_parser("check", help="validate a YAML hierarchy and print it resolved")
    check.add_argument("file")
    check.add_argument("--block-bytes", help="size of one block, e.g. 2MiB, to resolve byte capacities into blocks")

    inspect = sub.add_parser("inspect", help="what a file tier holds (read-only)")
    inspect.add_argument("root_dir")
    inspect.add_argument("--verify", action="store_true", help="read every block and check its checksum")
    inspect.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            from kvtier.cli.bench import run_bench

            return run_bench(args)
        if args.command == "config" and args.config_command == "check":
            from kvtier.cli.config_check import run_config_check

            return run_config_check(args)
        if args.command == "inspect":
            from kvtier.cli.inspect import run_inspect

            return run_inspect(args)
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
