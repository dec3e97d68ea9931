"""Run one vLLM engine with kvtier in this process and play a list of steps; write a JSON report.

    python tests/integration/vllm_runner.py JOB.json REPORT.json

JOB keys: `model` (folder), `kvtier_config` (path or mapping), `block_size` (engine tokens per
block), `offload_block_size` (tokens per offloaded block; default block_size), `num_gpu_blocks`,
`max_model_len`, `max_tokens`, `tensor_parallel_size` (default 1; above 1 the workers run as
processes, vLLM's "mp" executor), `spec` (optional: {"name", "module", "extra"} to run another
offloading spec, e.g. vLLM's own; {"name": "none"} runs without a connector), `connector` (optional:
{"name", "module"}, the connector class; default vLLM's `OffloadingConnector`),
`kv_load_failure_policy` (optional: "recompute" or "fail", vLLM's), `steps`: a list of
  {"op": "generate", "name": N, "prompt": TEXT}   greedy; records tokens, seconds, metric deltas
                                                  (either generate op: "kv_transfer_params": {...} is
                                                  sent with each request, as an OpenAI client sends it)
  {"op": "generate_many", "name": N, "prompts": [TEXT, ...]}
                                                  the prompts as concurrent requests (one call);
                                                  records `outputs` (per prompt: tokens, text,
                                                  prompt_token_ids) and the step's metric deltas
  {"op": "reset"}                                 llm.reset_prefix_cache(): empties the engine cache
  {"op": "corrupt_file_tier", "root_dir": DIR}    flips one payload byte of every slot on disk
                                       (with "slot": S, of slot S only; with "part": [I, N], a
                                       byte of part I of N of each payload: one TP rank's bytes)
  {"op": "sleep", "seconds": S}
  {"op": "kill", "pid": P}                        kill -9 process P (e.g. the host owner, `shared: host`)
  {"op": "barrier", "dir": DIR, "name": N, "parties": K}
                                                  waits until K engines reached barrier N (files in DIR)
Each generate record has `tokens`, `text`, `seconds` and `metrics` (the change, during the step,
of every counter whose name contains "prefix_cache", "kv_offload" or "kvtier").
Engines need the `if __name__ == "__main__"` guard: vLLM spawns worker processes.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        name = getattr(m, "name", "")
        if not any(s in name for s in ("prefix_cache", "kv_offload", "kvtier")):
            continue
        value = getattr(m, "value", None)
        if value is None:  # histograms
            value = getattr(m, "count", None)
        if not isinstance(value, (int, float)):
            continue
        labels = getattr(m, "labels", {}) or {}
        tier = labels.get("tier")
        key = f"{name}[{tier}]" if tier else name
        out[key] = out.get(key, 0) + value
    return out


def corrupt_file_tier(root_dir: str, only: int | None = None, part: tuple[int, int] = (0, 1)) -> int:
    """Flip one payload byte in every slot (or slot `only`) of the slab under `root_dir`, in part
    `part[0]` of `part[1]` equal parts of the payload; returns slots touched."""
    from kvtier.tiers.file.backend import HEADER_BYTES, MANIFEST, SLAB

    manifest = json.load(open(os.path.join(root_dir, MANIFEST)))
    slot_bytes, num_slots = manifest["slot_bytes"], manifest["num_slots"]
    at = HEADER_BYTES + part[0] * (manifest["block_bytes"] // part[1]) + 7
    n = 0
    with open(os.path.join(root_dir, SLAB), "r+b") as f:
        for slot in range(num_slots) if only is None else [only]:
            pos = slot * slot_bytes + at
            f.seek(pos)
            b = f.read(1)
            if not b:
                break
            f.seek(pos)
            f.write(bytes([b[0] ^ 0xFF]))
            n += 1
        f.flush()
        os.fsync(f.fileno())
    return n


def main(job_path: str, report_path: str) -> None:
    job = json.load(open(job_path))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    spec = job.get("spec")
    if spec is not None and spec.get("name") == "none":
        extra = {}
    elif spec is None:
        extra = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
                 "kvtier_config": job["kvtier_config"]}
    else:
        extra = {"spec_name": spec["name"], "spec_module_path": spec["module"], **spec.get("extra", {})}
    if job.get("offload_block_size"):
        extra["block_size"] = job["offload_block_size"]
    connector = job.get("connector") or {"name": "OffloadingConnector", "module": None}
    policy = {"kv_load_failure_policy": job["kv_load_failure_policy"]} if job.get("kv_load_failure_policy") else {}
    kv = KVTransferConfig(kv_connector=connector["name"], kv_connector_module_path=connector.get("module"),
                          kv_role="kv_both", kv_connector_extra_config=extra, **policy)
    if spec is not None and spec.get("name") == "none":  # no offloading at all (recompute baseline)
        kv = None
    tp = int(job.get("tensor_parallel_size", 1))
    parallel = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], enforce_eager=True, enable_prefix_caching=True, block_size=job["block_size"],
              num_gpu_blocks_override=job["num_gpu_blocks"], max_model_len=job.get("max_model_len", 2048),
              max_num_batched_tokens=job.get("max_num_batched_tokens", job.get("max_model_len", 2048)),
              kv_transfer_config=kv, disable_log_stats=False, dtype=job.get("dtype", "float32"),
              seed=0, gpu_memory_utilization=0.5, max_num_seqs=job.get("max_num_seqs", 4), **parallel)
    report: dict = {"startup_seconds": time.perf_counter() - t0, "steps": []}
    plain = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), ignore_eos=True)
    for step in job["steps"]:
        op = step["op"]
        if "kv_transfer_params" in step:
            params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), ignore_eos=True,
                                    extra_args={"kv_transfer_params": step["kv_transfer_params"]})
        else:
            params = plain
        if op == "generate":
            before = _counters(llm)
            start = time.perf_counter()
            out = llm.generate([step["prompt"]], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            time.sleep(step.get("settle", 0.5))  # let the stores of this request finish
            after = _counters(llm)
            delta = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
            report["steps"].append({"op": op, "name": step["name"], "tokens": list(out.outputs[0].token_ids),
                                    "text": out.outputs[0].text, "prompt_tokens": len(out.prompt_token_ids),
                                    "seconds": seconds, "metrics": delta})
        elif op == "generate_many":
            before = _counters(llm)
            start = time.perf_counter()
            outs = llm.generate(list(step["prompts"]), params, use_tqdm=False)
            seconds = time.perf_counter() - start
            time.sleep(step.get("settle", 0.5))
            after = _counters(llm)
            delta = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
            outputs = [{"tokens": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                        "prompt_token_ids": list(o.prompt_token_ids)} for o in outs]
            report["steps"].append({"op": op, "name": step["name"], "outputs": outputs, "seconds": seconds,
                                    "metrics": delta})
        elif op == "reset":
            ok = llm.reset_prefix_cache()
            report["steps"].append({"op": op, "ok": bool(ok)})
        elif op == "corrupt_file_tier":
            slots = corrupt_file_tier(step["root_dir"], step.get("slot"), tuple(step.get("part", (0, 1))))
            report["steps"].append({"op": op, "slots": slots})
        elif op == "sleep":
            time.sleep(step["seconds"])
        elif op == "kill":
            import signal

            os.kill(int(step["pid"]), signal.SIGKILL)
            report["steps"].append({"op": op, "pid": step["pid"]})
        elif op == "barrier":
            barrier(step["dir"], step["name"], step["parties"], step.get("timeout", 900))
        else:
            raise ValueError(f"unknown op {op!r}")
    report["final_metrics"] = _counters(llm)
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    del llm


def barrier(folder: str, name: str, parties: int, timeout: float) -> None:
    """Mark this process as arrived at barrier `name`, then wait until `parties` processes did
    (side-by-side benchmarks: engines meet the same load when they run each request together)."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, f"{name}.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout
    while sum(f.startswith(f"{name}.") for f in os.listdir(folder)) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r}: fewer than {parties} engines arrived in {timeout:g} s")
        time.sleep(0.005)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
