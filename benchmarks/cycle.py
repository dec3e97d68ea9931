"""CPU cost of the request cycle per trace block, kvtier against vLLM's LRU manager (issue 19).

    python -m benchmarks.cycle [--repeats 5] [--capacity 10000] [--multi] [--json FILE]
    python -m benchmarks.cycle --callgrind [--workloads agentic] [--systems lru,prefix-freq]

Four workloads: the Mooncake conversation and synthetic traces (`--traces`, default
/work/shared/traces or $KVTIER_TRACES), the generated hit-heavy agentic workload
(`workloads.generate_agentic_trace`) and the generated one-shot-scan workload
(`workloads.generate_scan_trace`). Systems: kvtier with `lru` and with `prefix-freq` in one tier of
`--capacity` blocks, vLLM 0.32's `CPUOffloadingManager` with LRU at the same capacity, and with
`--multi` kvtier with each policy over a file tier nine times larger (`lru+file`, ...). Named in
`--systems`, `prefix-freq-py` and `lru-py` are the pure-Python policies the compiled indexes
replaced (their fallbacks).

Default mode: every (workload, system) replayed `--repeats` times in interleaved rounds (round r
runs every system once, so all meet the same machine load); each keeps its least CPU time
(`time.process_time`, this process only). Ratios are kvtier's CPU time per block over vLLM LRU's.

`--callgrind`: each kvtier system replayed once in a child process under valgrind's callgrind,
collecting only inside `replay.drive` (the request cycle; not imports, set-up or key building):
instructions per trace block, which no other process on the machine can disturb. vLLM's manager
is left out unless named in `--systems` (importing vLLM under callgrind takes many minutes).

Hit rates are deterministic: any change to the manager must leave them equal to the last digit.
This is a benchmark, not a test: it prints rows and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import child_env
from kvtier.bench import replay, workloads
from kvtier.bench.provenance import provenance

WORKLOADS = ("conversation", "synthetic", "agentic", "scan")
SYSTEMS = ("lru", "prefix-freq", "vllm-lru")
MULTI = ("lru+file", "prefix-freq+file")
DEFAULT_TRACES = "/work/shared/traces"


def load_workload(name: str, traces: str) -> workloads.Trace:
    """The trace of workload `name` (one of `WORKLOADS`)."""
    if name == "agentic":
        return workloads.generate_agentic_trace()
    if name == "scan":
        return workloads.generate_scan_trace()
    if name in ("conversation", "synthetic"):
        return workloads.load_trace(Path(traces) / f"mooncake_{name}.jsonl")
    raise ValueError(f"--workloads: unknown workload {name!r} (expected one of {', '.join(WORKLOADS)})")


def config_for(system: str, capacity: int):
    """The dry-run hierarchy of kvtier system `system` ('lru', 'prefix-freq+file', ...): the
    packaged replay config (`replay-cpu.yaml`, or `replay-cpu-file.yaml` for '+file') with the
    first tier's policy and capacity replaced ('lru+file:arc': the file tier's policy too). The
    first tier's policy may be a pure-Python one (`memory.PURE`: 'prefix-freq-py', 'lru-py')."""
    from dataclasses import replace

    from benchmarks.memory import PURE
    from kvtier.config import Capacity, load_config

    policy, _, below = system.partition("+")
    name = "replay-cpu-file.yaml" if below else "replay-cpu.yaml"
    config = load_config(Path(__file__).resolve().parent.parent / "configs" / name)
    first = replace(config.tiers[0], capacity=Capacity(blocks=capacity), policy=PURE.get(policy, policy))
    lower_policy = below.partition(":")[2]
    rest = tuple(replace(t, policy=lower_policy) if lower_policy else t for t in config.tiers[1:])
    return replace(config, tiers=(first, *rest))


def run_one(system: str, trace: workloads.Trace, capacity: int) -> dict[str, Any]:
    """Replay `trace` once through `system`; the replay's result row."""
    if system == "vllm-lru":
        return replay.replay_vllm(capacity, "lru", trace)
    return replay.replay_kvtier(config_for(system, capacity), trace)


def _row(workload: str, system: str, r: dict[str, Any]) -> dict[str, Any]:
    return {"workload": workload, "system": system, "blocks": r["blocks"], "hit_rate": r["hit_rate"],
            "hit_blocks": r["hit_blocks"], "cpu_us_per_block": r["cpu_us_per_block"],
            "stores_refused": r["stores_refused"], "retry_steps": r["retry_steps"]}


def measure_cpu(workloads: list[str], systems: list[str], capacity: int, repeats: int, traces: str) -> list[dict]:
    rows = []
    for workload in workloads:
        trace = load_workload(workload, traces)
        best: dict[str, dict[str, Any]] = {}
        for _ in range(repeats):
            for system in systems:
                r = run_one(system, trace, capacity)
                if system not in best or r["cpu_us_per_block"] < best[system]["cpu_us_per_block"]:
                    best[system] = r
        done = [_row(workload, system, best[system]) for system in systems]
        for row in done:
            _print(row, done)
        rows += done
    return rows


def _print(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    ref = next((r for r in rows if r["workload"] == row["workload"] and r["system"] == "vllm-lru"), None)
    cost = row.get("instructions_per_block", row.get("cpu_us_per_block"))
    ratio = ""
    if ref is not None and row is not ref and "cpu_us_per_block" in row:
        ratio = f"{row['cpu_us_per_block'] / ref['cpu_us_per_block']:8.2f}x"
    print(f"{row['workload']:<14}{row['system']:<18}{row['hit_rate']:>10.6f}{cost:>18,.2f}{ratio:>10}", flush=True)


# ------------------------------------------------------------------------------------ callgrind
def _child(workload: str, system: str, capacity: int, traces: str, out: str) -> None:
    """In the callgrind child: replay once with `replay.drive` wrapped in `functools.reduce`,
    the C function that callgrind's --toggle-collect names (nothing else calls it meanwhile)."""
    trace = load_workload(workload, traces)
    inner = replay.drive

    def wrapped(*args: Any) -> Any:
        return functools.reduce(lambda _, f: f(), [lambda: inner(*args)], None)

    replay.drive = wrapped  # type: ignore[assignment]
    r = run_one(system, trace, capacity)
    Path(out).write_text(json.dumps(_row(workload, system, r)))


def measure_callgrind(workloads: list[str], systems: list[str], capacity: int, traces: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-cg-") as tmp:
        for workload in workloads:
            for system in systems:
                out, cg = os.path.join(tmp, "row.json"), os.path.join(tmp, "callgrind.out")
                cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
                       f"--callgrind-out-file={cg}", sys.executable, "-m", "benchmarks.cycle", "--child",
                       f"{workload}:{system}:{out}", "--capacity", str(capacity), "--traces", traces]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
                row = json.loads(Path(out).read_text())
                match = re.search(r"^(?:summary|totals): (\d+)", Path(cg).read_text(), re.M)
                assert match is not None, "callgrind wrote no totals"
                row.pop("cpu_us_per_block")  # inflated by the instrumentation: meaningless here
                row["instructions_per_block"] = int(match.group(1)) / row["blocks"]
                rows.append(row)
                _print(row, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--systems", default=None,
                        help=f"default {','.join(SYSTEMS)} (+ {','.join(MULTI)} with --multi)")
    parser.add_argument("--multi", action="store_true", help="add kvtier over a file tier (cascade on_evict)")
    parser.add_argument("--capacity", type=int, default=10_000, help="first-tier blocks (default 10000)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; each system keeps its best")
    parser.add_argument("--traces", default=os.environ.get("KVTIER_TRACES", DEFAULT_TRACES))
    parser.add_argument("--callgrind", action="store_true", help="instructions per block under callgrind")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        workload, system, out = args.child.split(":", 2)
        _child(workload, system, args.capacity, args.traces, out)
        return 0
    workloads = [w for w in args.workloads.split(",") if w]
    if args.systems:
        systems = [s for s in args.systems.split(",") if s]
    elif args.callgrind:
        systems = [s for s in SYSTEMS if s != "vllm-lru"] + (list(MULTI) if args.multi else [])
    else:
        systems = list(SYSTEMS) + (list(MULTI) if args.multi else [])
    unit = "instructions/blk" if args.callgrind else "CPU us/blk"
    print(f"{'workload':<14}{'system':<18}{'hit rate':>10}{unit:>18}{'vs vLLM':>10}")
    if args.callgrind:
        rows = measure_callgrind(workloads, systems, args.capacity, args.traces)
    else:
        rows = measure_cpu(workloads, systems, args.capacity, args.repeats, args.traces)
    if args.json:
        doc = {"schema": "kvtier.bench.cycle/1", **provenance(), "load": os.getloadavg(),
               "capacity": args.capacity, "repeats": 1 if args.callgrind else args.repeats,
               "unit": unit, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
