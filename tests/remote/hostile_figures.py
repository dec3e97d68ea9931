"""Figures of the shared tier against hostile servers (issue 27): not a test, a script.

    PYTHONPATH=. python tests/remote/hostile_figures.py [--seconds 60] [--only delay|drip]

Starts a valkey-server (or redis-server) on loopback (tests/remote/servers.py) and, for each proxy
in front of it (every reply held 200 ms; every reply dripped 1 byte per 20 ms), runs an engine with
the default shared-tier settings (`timeout_ms: 250`) for `--seconds`: every 10 ms step it looks up
a block another engine published (found by a probe, then promoted) and a block nobody has, and
keeps looking up each until it answers something other than RETRY. Prints, per proxy: RSS at the
start and its growth, the longest time a lookup answered RETRY (keys still in RETRY at the end
count with their age), probe batches requested / sent, and how long `close()` took. Targets: RSS
growth < 5 MB, every lookup answered within one step + timeout_ms, close <= timeout_ms + 100 ms.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from servers import start_server  # noqa: E402
from test_shared_tier import RETRY, Engine, keys  # noqa: E402

from tests.support.slow_proxy import SlowProxy  # noqa: E402

STEP_S = 0.01
PROXIES = {"delay": {"delay_s": 0.2}, "drip": {"drip_s": 0.02}}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(port: int, url: str, kind: str, seconds: float, known: list[bytes]) -> dict:
    """One proxy's figures (module docstring)."""
    with SlowProxy(port, **PROXIES[kind]) as proxy:
        engine = Engine(", key_prefix: 'kvt:figures'", url=proxy.url, hot=64, handles=4096)
        manager, waiting, worst = engine.manager, {}, 0.0
        start = time.monotonic()
        rss0 = rss_mb()
        for step in range(int(seconds / STEP_S)):
            now = time.monotonic()
            if now - start > seconds:
                break
            for key in (known[step % len(known)], keys(1, 1_000_000 + step)[0]):
                waiting.setdefault(key, now)
            for key, since in list(waiting.items()):
                if manager.lookup(key) != RETRY:
                    worst = max(worst, now - since)
                    del waiting[key]
            manager.on_schedule_end()
            time.sleep(STEP_S)
        now = time.monotonic()
        worst = max([worst] + [now - since for since in waiting.values()])
        rss1 = rss_mb()
        stats, counters = engine.stats(), dict(engine.shared.counters)
        closing = time.monotonic()
        engine.close()
        close_s = time.monotonic() - closing
    return {"proxy": kind, "seconds": round(now - start, 1), "rss_start_mb": round(rss0, 1),
            "rss_growth_mb": round(rss1 - rss0, 1), "worst_retry_ms": round(worst * 1000),
            "still_retry": len(waiting), "batches_requested": stats.get("probes"),
            "batches_sent": counters.get("probes"), "batches_shed": counters.get("probes_shed", "n/a"),
            "breaker_misses": stats.get("breaker_misses"), "close_ms": round(close_s * 1000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each proxy's run lasts (default 60)")
    parser.add_argument("--only", choices=sorted(PROXIES), help="run one proxy only")
    args = parser.parse_args()
    server = start_server(Path(tempfile.mkdtemp(prefix="kvtier-figures-")))
    try:
        publisher = Engine(", key_prefix: 'kvt:figures', timeout_ms: 2000", url=server.url, hot=64, handles=4096)
        known = keys(3000, 500_000)
        for i in range(0, len(known), 50):
            publisher.store(known[i:i + 50])
            publisher.manager.wait_idle(30)
        publisher.close()
        for kind in [args.only] if args.only else sorted(PROXIES):
            print(run(server.port, server.url, kind, args.seconds, known), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
