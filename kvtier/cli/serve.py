"""`kvtier serve`: run the host owner of the shared hierarchies (`kvtier.host`) until stopped.

Engines whose YAML says `shared: host` connect to it. SIGTERM or SIGINT stops it: it writes each
namespace's CPU blocks to the tier below (at most --flush-timeout seconds), then exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from kvtier.config.shared import default_socket_path, socket_path_problem
from kvtier.core.errors import ArgumentError


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="run the host owner of the tiers that engines with 'shared: host' share",
                           description="Own the shared hierarchies of this host: engines (vLLM or the standalone "
                                       "KVTier) whose YAML says 'shared: host' use its CPU region and file tiers. "
                                       "Listens on a Unix socket (0600, in a directory only this user can enter); "
                                       "serves this user's processes only. Stops on SIGTERM or SIGINT after "
                                       "writing its CPU tiers down.")
    serve.add_argument("--socket", default=None, metavar="PATH",
                       help=f"the Unix socket to listen on (default: {default_socket_path()}; the YAML's "
                            f"shared.socket must name the same)")
    serve.add_argument("--max-clients", type=int, default=64, metavar="N", help="engines served at once (default 64)")
    serve.add_argument("--flush-timeout", type=float, default=60.0, metavar="S",
                       help="at stop (and when an idle namespace closes), seconds to write the CPU tiers down "
                            "(default 60)")
    serve.add_argument("--max-namespaces", type=int, default=16, metavar="N",
                       help="model identities served at once, each with a CPU region of its own (default 16)")
    serve.add_argument("--idle-namespace-s", type=float, default=600.0, metavar="S",
                       help="close a model identity's namespace no engine has used for S seconds: its CPU tiers "
                            "are written down and its region freed (default 600; 0: keep it until the owner stops)")


def run_serve(args: argparse.Namespace) -> int:
    from kvtier.host.owner import HostOwner

    path = default_socket_path() if args.socket is None else args.socket  # "" is refused, not the default
    problem = socket_path_problem(path)
    if problem:
        raise ArgumentError(f"--socket: {problem}")
    if args.max_clients < 1:
        raise ArgumentError(f"--max-clients: expected at least 1, got {args.max_clients}")
    if args.max_namespaces < 1:
        raise ArgumentError(f"--max-namespaces: expected at least 1, got {args.max_namespaces}")
    for name, value in (("--idle-namespace-s", args.idle_namespace_s), ("--flush-timeout", args.flush_timeout)):
        if not value >= 0 or value == float("inf"):
            raise ArgumentError(f"{name}: expected a finite number of seconds >= 0, got {value:g}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    owner = HostOwner(path, max_clients=args.max_clients, max_namespaces=args.max_namespaces,
                      idle_namespace_s=args.idle_namespace_s, flush_timeout=args.flush_timeout)
    stop = threading.Event()
    # (installed once the owner exists, and put back at the end: a refused start changes no handler)
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    print(f"kvtier serve: listening on {path}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
        print("kvtier serve: stopping (writing the CPU tiers down)", flush=True)
    finally:
        owner.close(args.flush_timeout)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print("kvtier serve: stopped", flush=True)
    return 0
