"""The `shared:` setting of a hierarchy: its tiers live in a host owner that several engines share.

    shared: host                       # the default socket, timeout_ms 50
    shared:
      scope: host
      socket: /run/user/1000/kvtier/host.sock
      timeout_ms: 50

With it, an engine (under vLLM, or the standalone `KVTier`) builds no tier of its own: it asks the
host owner (`kvtier serve`, `kvtier.host`) for the hierarchy its YAML describes, and every engine of
the same model identity on the host uses that one hierarchy. `timeout_ms` bounds every call to
the owner: past it, the call is a miss (or a store skipped), never a stall.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvtier.core.types import DEFAULT_CASCADE, DEFAULT_RESERVE

DEFAULT_TIMEOUT_MS = 50
MAX_TIMEOUT_MS = 60_000
SOCKET_PATH_MAX = 107  # bytes of sun_path, without its terminating NUL (Linux)
SCOPES = ("host",)


def default_socket_path() -> str:
    """Where `kvtier serve` listens and engines connect when the YAML names no socket: a directory
    only this user can enter, under `$XDG_RUNTIME_DIR` when it is set, else under /tmp."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    directory = os.path.join(runtime, "kvtier") if runtime else f"/tmp/kvtier-{os.getuid()}"
    return os.path.join(directory, "host.sock")


@dataclass(frozen=True)
class SharedHost:
    """Where the host owner listens (`socket`) and how long an engine waits for one answer."""

    socket: str
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000


def socket_path_problem(path: Any) -> str | None:
    """Why `path` cannot be the owner's socket (None: it can)."""
    if not isinstance(path, str) or not path:
        return f"expected an absolute path for a Unix socket, got {path!r}"
    if not os.path.isabs(path):
        return f"expected an absolute path for a Unix socket, got {path!r} (relative)"
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        return f"a Unix socket path holds at most {SOCKET_PATH_MAX} bytes; {path!r} has {len(os.fsencode(path))}"
    return None


def parse_shared(value: Any) -> SharedHost:
    """`shared:` of a config: `host`, or a mapping with `scope: host` and optional `socket`
    (absolute path) and `timeout_ms` (1 to 60000). ValueError saying which parts are wrong (all
    of them at once)."""
    if value == "host":
        return SharedHost(default_socket_path())
    if not isinstance(value, dict):
        raise ValueError(f"expected 'host' or a mapping {{scope: host, socket: PATH, timeout_ms: N}}, got {value!r}")
    problems = []
    unknown = sorted(set(value) - {"scope", "socket", "timeout_ms"})
    if unknown:
        problems.append(f"unknown key(s) {', '.join(map(str, unknown))} (valid keys: scope, socket, timeout_ms)")
    if value.get("scope", "host") not in SCOPES:
        problems.append(f"scope: {value.get('scope')!r} is not one of {', '.join(SCOPES)}")
    socket = value.get("socket")
    socket = default_socket_path() if socket is None else socket  # (an empty string is refused, not the default)
    problem = socket_path_problem(socket)
    if problem:
        problems.append(f"socket: {problem}")
    timeout = value.get("timeout_ms", DEFAULT_TIMEOUT_MS)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= MAX_TIMEOUT_MS:
        problems.append(f"timeout_ms: expected an integer from 1 to {MAX_TIMEOUT_MS} (milliseconds), got {timeout!r}")
    if problems:
        raise ValueError("; ".join(problems))
    return SharedHost(socket, timeout)


def config_mapping(config: Any) -> dict[str, Any]:
    """A `HierarchyConfig` as the plain mapping its YAML could have been (what an engine sends the
    host owner, which builds the shared hierarchy from it): tiers with their options, without
    `shared` and `block_bytes` (the owner has the engine's). A tier's `cascade` and `reserve` are
    given only where they differ from their defaults, as its YAML could give them (on a tier with
    no tier below, where a default one has no effect, one given is refused)."""
    tiers = []
    for tier in config.tiers:
        capacity = tier.capacity
        chain = {k: v for k, v, default in (("cascade", tier.cascade, DEFAULT_CASCADE),
                                            ("reserve", tier.reserve, DEFAULT_RESERVE)) if v != default}
        tiers.append({"name": tier.name, "backend": tier.backend, "policy": tier.policy, **chain, **dict(tier.options),
                      "capacity": f"{capacity.blocks} blocks" if capacity.blocks is not None else f"{capacity.bytes}B"})
    return {"block_tokens": config.block_tokens, "store_threshold": config.store_threshold, "tiers": tiers}
