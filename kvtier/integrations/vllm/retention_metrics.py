"""The sessions' retention hints (`kvtier.control.retention`) as vLLM metrics:
`vllm:kvtier_retention_<name>`, counters (deltas since the last report) and gauges, without a tier
label (a retention holds blocks in every tier); and each tier's `retained_blocks` gauge, recounted
at most every `RECOUNT_S` (`RetainedGauges`: vLLM asks for metrics every scheduler step)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

from kvtier.control.hints import RequestHints
from kvtier.host.wire import hint_fields

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
    `last` (updated), gauges as they are. A number missing from `report` is left as it was (a
    counter unchanged, a gauge not set); a counter lower than before (the host owner restarted)
    counts again from 0."""
    for name in RETENTION_COUNTERS:
        before = last.get(name, 0)
        now = last[name] = report.get(name, before)
        delta = now - before if now >= before else now
        if delta:
            stats.increase_counter(PREFIX + name, delta)
    for name in RETENTION_GAUGES:
        if name in report:
            stats.set_gauge(PREFIX + name, report[name])
    return stats


@dataclass
class HintCounts:
    """One engine's requests' hints, counted once per request: `RetentionStats`' names."""

    hints: int = 0
    hints_refused: int = 0


class EngineHints:
    """Under `shared: host`: the hints of this engine's requests, and the retention it reports.
    A request's hint is read once (`RequestHints`, as a private hierarchy's `Retention` reads
    it): counted once, in `hints` or, invalid, in `hints_refused` (logged once, the request
    served without it), and sent to the owner as a plain dict (`of`)."""

    def __init__(self) -> None:
        self.counts = HintCounts()
        self._requests = RequestHints(self.counts)

    def of(self, req_context: Any) -> dict[str, Any] | None:
        """The request's valid hint as the owner reads it (`hint_fields`); None: none."""
        return hint_fields(self._requests.of(req_context))

    def report(self, owner: dict[str, Any]) -> dict[str, Any]:
        """The retention as this engine reports it, under `Retention.report()`'s names: `hints` and
        `hints_refused` count its requests; the others are the owner's (`owner`: its `stats`
        answer), for every engine of the model as its tiers' gauges are, missing without one."""
        return {**(owner.get("retention") or {}), **asdict(self.counts)}


RECOUNT_S = 1.0  # how often `RetainedGauges` recounts the tiers' retained blocks


class RetainedGauges:
    """The tiers' rows for vLLM's metrics (`HierarchyManager.get_stats`), whose `retained_blocks`
    are recounted at most every `RECOUNT_S`: a recount looks each retained block up in every
    tier, and vLLM asks every scheduler step; in between, the last count is reported (at most
    `RECOUNT_S` old). The other numbers are read every time."""

    def __init__(self) -> None:
        self._at = float("-inf")
        self._counts: dict[str, int] = {}

    def rows(self, manager: Any) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        recount = now - self._at >= RECOUNT_S
        rows = manager.get_stats(retained=recount)
        if recount:
            self._at, self._counts = now, {tier: row.get("retained_blocks", 0) for tier, row in rows.items()}
        else:
            for tier, row in rows.items():
                row["retained_blocks"] = self._counts.get(tier, 0)
        return rows
