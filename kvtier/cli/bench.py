"""`kvtier bench [all|hops|trace]`: measure a hierarchy and explain the figures.

JSON output (schema "kvtier.bench/2", documented in docs/bench.md): `schema`, `kvtier_version`,
`created`, `machine`, `versions`, `config` (resolved), `file_hops_dir` and `hops` (list of rows;
both absent for `trace`), `trace` (absent for `hops`), `summary` (the sentences printed at the end).
Options are checked before anything is measured (`kvtier.cli.bench_options`), and so is the trace
(read, and a bad one refused, right after the config; `--json`/`--plot` are checked writable
without leaving a file behind); a transfer that moved
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
from kvtier.bench import hops_report, replay, trace_report, workloads
from kvtier.bench.hops import TransferCorrupted
from kvtier.bench.provenance import provenance
from kvtier.bench.sample import SAMPLE_BLOCK_TOKENS, SAMPLE_TRACE, sample_trace_path
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
    """`path`, checked to be writable by opening it to append; a file the check created is removed
    (written at the end, or never: a run that fails later leaves no empty file behind)."""
    if not path:
        return None
    target = Path(path)
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        raise OutputError(f"cannot write {what} {target}: {exc.strerror or exc}") from None
    if not existed:
        target.resolve().unlink(missing_ok=True)  # (resolved: through a dangling link, what it created)
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
    # The trace is read (and a bad one refused) before anything is measured: it needs the config's
    # block_tokens, so here rather than in check_options, which runs before the config is read.
    trace = _load_workload(args, checked, config) if mode in ("all", "trace") else None
    started = time.perf_counter()
    doc: dict[str, Any] = {"schema": SCHEMA, "kvtier_version": __version__, **provenance(),
                           "config": config_as_dict(config)}
    summary: list[str] = []
    try:
        if mode in ("all", "hops"):
            doc["file_hops_dir"], doc["hops"] = _run_hops(args, config, progress, checked)
            summary += hops_report.summary(doc["hops"])
        if trace is not None:  # (modes all and trace)
            doc["trace"] = _run_trace(args, config, progress, checked, trace)
            summary += trace_report.summary(doc["trace"])
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
    """Byte capacities become block counts with the config's block size (or 2 MiB); the rest of
    the config is kept (its `store_threshold` too), but a `shared` one is replayed in this process."""
    from dataclasses import replace

    from kvtier.config import Capacity, TierConfig

    block_bytes = config.block_bytes or DEFAULT_REPLAY_BLOCK_BYTES
    tiers = tuple(TierConfig(**{**t.__dict__, "capacity": Capacity(blocks=max(1, t.capacity.to_blocks(block_bytes)))})
                  for t in config.tiers)
    return replace(config, tiers=tiers, shared=None)


def _load_workload(args, checked: dict[str, Any], config) -> workloads.Trace:
    """The trace to replay: --trace (sessions inferred when hints are asked for; its blocks hold the
    config's block_tokens, the sample's Mooncake's 512) or --workload."""
    from kvtier.bench import sessions

    if args.trace:
        sample = args.trace == SAMPLE_TRACE
        path = sample_trace_path() if sample else args.trace
        tokens = SAMPLE_BLOCK_TOKENS if sample else config.block_tokens
        if checked["hints"] != "off":
            return sessions.load_session_trace(path, args.limit, tokens)
        return workloads.load_trace(path, args.limit, tokens)
    if checked["workload"] in sessions.WORKLOADS:
        generated = sessions.generate_session_trace(checked["workload"], scale=0.25 if args.quick else 1)
        return generated.head(args.limit) if args.limit else generated
    trace = workloads.generate_trace(num_conversations=60 if args.quick else 400)
    if args.limit:
        trace.requests = trace.requests[: args.limit]
    return trace


def _run_trace(args, config, progress: Progress, checked: dict[str, Any], trace: workloads.Trace) -> dict[str, Any]:
    from kvtier.bench import session_report
    from kvtier.bench.sessions import SessionHints, SessionTrace

    capacities = checked["capacities"]
    rcfg = _replay_config(args, config)
    if capacities is None and getattr(args, "bench_command", None) in (None, "all"):
        # The default run shows a hit-rate curve: a quarter, half and all of the first tier.
        full = rcfg.tiers[0].capacity.blocks
        capacities = sorted({max(1, full // 4), max(1, full // 2), full})
    progress.note(f"Trace: {trace.name}, {len(trace.requests)} requests, {trace.total_blocks} blocks "
                  f"(transfers complete at once, without bytes: this measures the control plane)")
    session_trace = trace if isinstance(trace, SessionTrace) else None
    retain_s = (checked["retain_s"] or session_trace.retain_s()) if session_trace is not None else 0.0
    hints = None
    if session_trace is not None and checked["hints"] != "off":
        def hints() -> SessionHints:
            return SessionHints(session_trace, retain_s)
    rows = replay.sweep(rcfg, trace, capacities, checked["policies"], args.compare == "vllm",
                        progress_factory=progress, repeats=args.repeats or 1, hints=hints,
                        without_hints=checked["hints"] != "on")
    optimum = _belady_ceilings(trace, rcfg, rows, ends=session_trace is not None)
    result = {"trace": trace.name, "requests": len(trace.requests), "blocks": trace.total_blocks,
              "optimum_hit_rate": trace.optimum_hit_rate(), "transfers": "immediate, no bytes", "runs": rows,
              "optimum": optimum, "notes": [n for n in (trace_report.vllm_capacity_note(rows),) if n]}
    if session_trace is not None:
        note = trace_report.session_note(session_trace, checked["hints"], checked["retain_s"])
        result["sessions"] = {"from": session_trace.sessions_from, "hints": checked["hints"], "retain_s": retain_s,
                              **({"note": note} if note else {}), **_session_counts(session_trace),
                              **session_report.compare(rows, optimum)}
    trace_report.print_trace(result)
    return result


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

    out = []
    for cap in sorted({r["capacity_blocks"] for r in rows}):
        total = replay.total_blocks(config.with_capacities(cap))  # (vLLM's capacity with --compare vllm too)
        out.append({"capacity_blocks": cap, "total_capacity_blocks": total, "hit_rate": optimum(trace, total)})
        if ends:
            out[-1]["ends_known"] = ends_known(trace, total)
    return out
