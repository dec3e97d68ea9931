"""The sessions' retention hints (`kvtier.control.retention`) as vLLM metrics:
`vllm:kvtier_retention_<name>`, counters (deltas since the last report) and gauges, without a tier
label (a retention holds blocks in every tier)."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

PREFIX = "vllm:kvtier_retention_"
RETENTION_COUNTERS: dict[str, str] = {
    "hints": "Requests' turns that carried a valid retention hint.",
    "hints_refused": "Retention hints refused as invalid (the requests were served without them).",
    "expired": "Sessions whose retention ran out.",
    "ended": "Sessions ended by a hint (their blocks released).",
    "displaced": "Sessions that lost their retention to the share of the first tier or the session limit.",
    "kept_past": "Evictions that took retained blocks (no room could be made otherwise).",
    "evicted_ended": "Blocks of ended sessions evicted before the policy's victims.",
}
RETENTION_GAUGES: dict[str, str] = {
    "sessions": "Sessions with a retention now.",
    "retained_blocks": "Blocks kept by the sessions' retentions now.",
    "budget_blocks": "The most blocks the retentions may keep (a share of the first tier).",
}


def retention_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The Prometheus definitions of the retention metrics."""
    defs: dict[str, OffloadingMetricMetadata] = {
        PREFIX + name: OffloadingCounterMetadata(documentation=f"kvtier: {doc}")
        for name, doc in RETENTION_COUNTERS.items()}
    defs.update({PREFIX + name: OffloadingGaugeMetadata(documentation=f"kvtier: {doc}")
                 for name, doc in RETENTION_GAUGES.items()})
    return defs


def record_retention(stats: Any, report: dict[str, int], last: dict[str, float]) -> Any:
    """Put `report` (`Retention.report()`) into vLLM's `stats` and return it: counter deltas since
    `last` (updated), gauges as they are."""
    for name in RETENTION_COUNTERS:
        delta = report[name] - last.get(name, 0)
        last[name] = report[name]
        if delta:
            stats.increase_counter(PREFIX + name, delta)
    for name in RETENTION_GAUGES:
        stats.set_gauge(PREFIX + name, report[name])
    return stats
