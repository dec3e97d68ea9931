"""What `kvtier bench trace` prints of a replay (`kvtier.cli.bench`): the table of runs, its notes,
the sessions table, and the Summary's sentences.

- `vllm_capacity_note(runs)`: vLLM's manager has one tier, so with `--compare vllm` it runs with
  kvtier's total across tiers (`kvtier.bench.replay.total_blocks`, as the optimum); over several
  tiers the note says how many blocks that is at each size (None over one tier: nothing differs).
- `session_note(trace, hints, retain_given)`: a hinted replay in which no session has two turns
  says what its hints can and cannot do (None otherwise).
- `print_trace(result)` and `summary(result)`: the table and the Summary.
"""

from __future__ import annotations

from typing import Any


def vllm_capacity_note(runs: list[dict[str, Any]]) -> str | None:
    """The note on vLLM's capacity when it differs from kvtier's first tier's (None otherwise)."""
    sizes = sorted({(r["capacity_blocks"], r["total_capacity_blocks"]) for r in runs if r["system"] == "vllm"})
    if all(first == total for first, total in sizes):
        return None
    at = ", ".join(f"{total:,} blocks at tier0 {first:,}" for first, total in sizes)
    return (f"vLLM runs with kvtier's total across tiers (its manager has one tier; the optimum uses the same "
            f"total), so both hold as many blocks: {at}")


def session_note(trace: Any, hints: str, retain_given: float | None) -> str | None:
    """What hints can do in a `SessionTrace` in which no session has two turns (None when one has,
    or without hints): nothing is kept for a next turn; a session that does not end at its turn
    (cut short by --limit) is released at once when `--retain-s auto` found no gap (retain_s 0)."""
    if hints == "off" or trace.gaps():
        return None
    live = any(s is not None and not last for s, last in zip(trace.sessions, trace.last_turn))
    note = "no session has two turns: hints keep nothing for a next turn"
    if not live:
        return note + " (every session ends at its only turn: hints only make each one's own blocks the first to go)"
    if retain_given is None:
        return note + ("; --retain-s auto found no gap between turns to measure, so a turn that does not end its "
                       "session releases it (retain_s 0); give --retain-s SECONDS to retain those sessions")
    return note


def run_label(r: dict[str, Any]) -> str:
    """A run's name in the table, the Summary and the plot: its policy, '+hints' when hinted."""
    return r["policy"] + ("+hints" if r.get("hints") else "")


def print_trace(result: dict[str, Any]) -> None:
    """The table of runs (and the optimum), its notes, and the sessions table."""
    w = max([13, *(len(run_label(r)) + 1 for r in result["runs"])])  # the policy column
    print(f"\n{'system':<8}{'policy':<{w}}{'tier0 blocks':>13}{'hit rate':>10}{'block ops/s':>13}"
          f"{'CPU us/blk':>11}  per tier")
    for r in result["runs"]:
        tiers = ", ".join(f"{n} {t['hit_rate']:.3f}" for n, t in r.get("tiers", {}).items())
        extra = ""
        if r["system"] == "vllm" and r.get("total_capacity_blocks", r["capacity_blocks"]) != r["capacity_blocks"]:
            extra = f" ({r['total_capacity_blocks']:,} blocks)"
        if "vs_vllm_lru" in r:
            extra = (f"  [{r['vs_vllm_lru']['block_ops_per_s']:.1f}x vLLM LRU ops/s, "
                     f"{r['vs_vllm_lru']['cpu_per_block']:.2f}x its CPU/block]")
        print(f"{r['system']:<8}{run_label(r):<{w}}{r['capacity_blocks']:>13}{r['hit_rate']:>10.4f}"
              f"{r['block_ops_per_s']:>13,.0f}{r['cpu_us_per_block']:>11.2f}  {tiers}{extra}")
    for o in result.get("optimum", []):
        print(f"{'offline':<8}{'Belady':<{w}}{o['capacity_blocks']:>13}{o['hit_rate']:>10.4f}{'-':>13}{'-':>11}  "
              f"optimum for {o['total_capacity_blocks']} blocks in all")
    print(f"(offline ceiling with unlimited space: {result['optimum_hit_rate']:.4f})")
    for note in result.get("notes", []):
        print(f"note: {note}")
    sessions = result.get("sessions")
    if sessions:
        _print_sessions(sessions)


def _print_sessions(sessions: dict[str, Any]) -> None:
    from kvtier.bench import session_report

    print(f"\nSessions ({sessions['from']}): {sessions['sessions']} sessions, "
          f"{sessions['one_time_requests']} one-time requests, gaps between turns p50 "
          f"{_seconds(sessions['gap_p50_s'])} p90 "
          f"{_seconds(sessions['gap_p90_s'])}; hints {sessions['hints']}, retain_s {sessions['retain_s']:g}")
    if sessions.get("note"):
        print(f"note: {sessions['note']}")
    for line in session_report.table(sessions):
        print(line)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def summary(result: dict[str, Any]) -> list[str]:
    """The Summary's sentences: each kvtier run (with hints too) against the optimum at its size,
    its ratios to vLLM where vLLM ran, then the notes and the sessions' sentences."""
    belady = {o["capacity_blocks"]: o["hit_rate"] for o in result.get("optimum", [])}
    lines = []
    for r in (r for r in result["runs"] if r["system"] == "kvtier"):
        per_tier = ", ".join(f"{n} {t['hit_rate']:.1%}" for n, t in r["tiers"].items())
        ceiling = belady.get(r["capacity_blocks"])
        of = (f"of the offline optimum {ceiling:.1%} at this size ({result['optimum_hit_rate']:.1%} with "
              f"unlimited space)" if ceiling is not None else f"of a {result['optimum_hit_rate']:.1%} ceiling")
        lines.append(f"{run_label(r)} @ {r['capacity_blocks']} tier-0 blocks: hit rate {r['hit_rate']:.1%} "
                     f"({per_tier}) {of}; manager {r['block_ops_per_s']:,.0f} block ops/s, "
                     f"{r['cpu_us_per_block']:.2f} CPU us per trace block")
        if "vs_vllm_lru" in r:
            lines.append(f"  vs vLLM LRU: {r['vs_vllm_lru']['block_ops_per_s']:.1f}x block ops/s, "
                         f"{r['vs_vllm_lru']['cpu_per_block']:.2f}x its CPU time per block, "
                         f"hit rate {r['vs_vllm_best_hit_rate']:+.4f} vs vLLM's better policy "
                         f"(both with {r['total_capacity_blocks']:,} blocks in all)")
    lines += result.get("notes", [])
    if "sessions" in result:
        from kvtier.bench import session_report

        if result["sessions"].get("note"):
            lines.append(f"{result['trace']}: {result['sessions']['note']}")
        lines += session_report.summary(result["sessions"], result["trace"])
    return lines
