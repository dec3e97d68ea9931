"""A Prometheus endpoint for the standalone API: `KVTier.open(..., metrics_port=N)`.

Serves the numbers of `KVTier.stats()` as gauges, read at each scrape: `kvtier_tier_<counter>`
with a `tier` label for each tier's counters and occupancy (e.g. `kvtier_tier_resident_blocks
{tier="cpu"}`), `kvtier_engine_<counter>` for the API's store/load totals, in blocks, and
`kvtier_retention_<counter>` for the sessions' retention hints once one was given (a scrape
during a `store` or `load` waits for it: `stats()` runs between calls); each one's HELP says what
it counts. `prometheus_client`
(a vLLM dependency; `pip install kvtier[metrics]`) is imported only when an endpoint starts.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.core.errors import ArgumentError, ArgumentTypeError, ConfigError
from kvtier.standalone.counters import HELP as ENGINE_HELP
from kvtier.standalone.http import MetricsServer

_NAME = re.compile(r"[^a-zA-Z0-9_]")
# What each per-tier number of `KVTier.stats()` is (`kvtier.control.tier.TierStats` and
# `Tier.stats_row`), as HELP text; the engine's totals say it in `standalone_counters.HELP`.
TIER_HELP = {
    "hits": "blocks loaded into the engine that this tier supplied (directly or by promotion; not a failed one)",
    "stores": "blocks written into this tier (engine stores, demotions, promotions)",
    "evictions": "blocks evicted from this tier",
    "demotions": "blocks copied from this tier to the next one",
    "promotions": "blocks copied from this tier up to the first tier",
    "cascade_dropped": "dirty blocks evicted from this tier without a copy below",
    "cascade_dropped_failed": "of cascade_dropped (write-through): blocks whose copy below failed",
    "cascade_dropped_full": "of cascade_dropped (write-through): the next tier had no room or dropped its copy",
    "cascade_deferred": "blocks whose demotion did not start at once because too many were in flight (once a wait)",
    "failures": "blocks whose copy into or out of this tier failed (each counted once)",
    "publish_dropped": "blocks not published to this shared tier (in-flight bound, slow writes, server down)",
    "probes": "probe batches sent to this shared tier",
    "probe_keys": "keys in the probe batches sent to this shared tier",
    "probe_hits": "keys a probe of this shared tier found",
    "probe_failures": "probe batches of this shared tier that failed (their keys answered MISS)",
    "probe_timeouts": "keys whose probe of this shared tier did not answer in time (answered MISS)",
    "breaker_misses": "lookups answered MISS at once: this shared tier's server was considered down",
    "rejected": "blocks a promotion from this tier could not read (gone, failed verification): recomputed",
    "bytes_in": "bytes written into this tier",
    "bytes_out": "bytes read from this tier",
    "seconds_in": "seconds spent writing into this tier",
    "seconds_out": "seconds spent reading from this tier",
    "capacity_blocks": "blocks this tier can hold",
    "resident_blocks": "blocks this tier holds now",
    "free_blocks": "free slots of this tier's backend now",
    "retained_blocks": "blocks of this tier kept by sessions' retention hints now",
    "ended_blocks": "blocks of this tier from ended sessions, to be evicted first",
}
# The sessions' retention (`Retention.report`, `stats()["engine"]["retention"]` once a hint was
# given): `kvtier_retention_<name>`, without a tier label (a retention holds blocks in every tier).
RETENTION_HELP = {
    "hints": "turns that carried a valid retention hint",
    "hints_refused": "retention hints refused as invalid",
    "expired": "sessions whose retention ran out",
    "ended": "sessions ended by a hint (their blocks released, the ones they stored evicted first)",
    "displaced": "sessions that lost their retention to the first tier's share or the session limit",
    "kept_past": "evictions that took retained blocks (no room could be made otherwise)",
    "evicted_ended": "blocks of ended sessions evicted before the policy's victims",
    "sessions": "sessions retaining blocks now",
    "retained_blocks": "blocks the sessions' retentions keep now, all tiers together",
    "budget_blocks": "the most blocks retentions may keep (a share of the first tier)",
}


def check_metrics_port(port: Any, addr: Any = "127.0.0.1") -> None:
    """Refuse a `metrics_port` that is not None or a TCP port (0: any free one), and a
    `metrics_addr` that is not a non-empty address string, naming them."""
    if port is None:
        return
    if type(port) is not int:
        raise ArgumentTypeError(f"metrics_port: {type(port).__name__} {port!r}; an int port (0: any free port)")
    if not 0 <= port <= 65535:
        raise ArgumentError(f"metrics_port: {port} is not a TCP port; use 0..65535 (0: any free port)")
    if not isinstance(addr, str):  # None would listen on every interface
        raise ArgumentTypeError(f"metrics_addr: {type(addr).__name__} {addr!r}; an address string such as "
                                f"'127.0.0.1' (the default: this host only) or '0.0.0.0' (every interface)")
    if not addr.strip():
        raise ArgumentError("metrics_addr: empty; an address such as '127.0.0.1' (the default: this host only)")


def stat_families(stats: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, str], float]]:
    """(metric name, help, labels, value) for each number of a `KVTier.stats()` dict; the help
    says what the number counts (`TIER_HELP`, `standalone_counters.HELP`)."""
    for group, values in stats.items():
        if not isinstance(values, dict):
            continue
        engine = group == "engine"
        prefix, labels = ("kvtier_engine", {}) if engine else ("kvtier_tier", {"tier": group})
        helps = ENGINE_HELP if engine else TIER_HELP
        if engine and isinstance(values.get("retention"), dict):
            for name, value in values["retention"].items():
                text = f"{RETENTION_HELP.get(name, name)} (KVTier.stats()['engine']['retention'][{name!r}])"
                yield f"kvtier_retention_{_NAME.sub('_', name)}", text, {}, float(value)
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                where = 'KVTier.stats()["engine"]' if engine else "KVTier.stats()[tier]"
                text = f"{helps.get(name, name)} ({where}[{name!r}])"
                yield f"{prefix}_{_NAME.sub('_', name)}", text, labels, float(value)


class _StatsCollector:
    """A `prometheus_client` collector reading `stats()` at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families: dict[str, Any] = {}
        for name, doc, labels, value in stat_families(self._stats()):
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(name, doc, labels=sorted(labels))
            family.add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()


class MetricsEndpoint:
    """An HTTP server on `addr:port` (0: a free port; see `url`) serving `stats()` at /metrics
    on its own thread, until `stop()` (idempotent), which also ends every connection a client
    still holds (`kvtier.standalone.http`). `addr` is loopback by default: the endpoint has no
    authentication, so listening on other interfaces is the caller's explicit choice."""

    def __init__(self, stats: Callable[[], dict[str, Any]], port: int, addr: str = "127.0.0.1"):
        try:
            from prometheus_client import CollectorRegistry, make_wsgi_app
        except ImportError:
            raise ConfigError([("metrics_port", "needs the prometheus_client package "
                                "(pip install 'kvtier[metrics]')")]) from None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_StatsCollector(stats))
        server = _bind(addr, port, make_wsgi_app(registry))
        server.start()
        self._server: MetricsServer | None = server  # (None once stopped)
        self.port: int = server.server_port
        host = f"[{addr}]" if ":" in addr else addr  # an IPv6 address is bracketed in a URL
        self.url = f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def _bind(addr: str, port: int, app: Any) -> MetricsServer:
    """A `MetricsServer` listening on `addr:port`; an `ArgumentError` naming `metrics_addr` for an
    address that is none of this host's, `metrics_port` for a port that cannot be had."""
    try:
        family, _type, _proto, _name, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                                    flags=socket.AI_PASSIVE)[0]
        return MetricsServer(str(sockaddr[0]), port, family, app)
    except socket.gaierror as exc:
        raise ArgumentError(f"metrics_addr: {addr!r} is no address of this host ({exc.strerror or exc}); "
                            "use '127.0.0.1' (the default) or an address of one of its interfaces") from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ArgumentError(f"metrics_addr: {addr!r} is not an address of any interface of this host "
                                f"({exc.strerror}); use '127.0.0.1' (the default), '0.0.0.0' (every interface) "
                                "or an address this host has") from None
        raise ArgumentError(f"metrics_port: cannot serve on {addr}:{port} ({exc}); "
                            "pick a free port, or 0 for any") from None
