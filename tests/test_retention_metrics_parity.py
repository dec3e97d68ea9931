"""The retention's numbers are the same under vLLM as standalone: every number `Retention.report()`
gives is served by the standalone endpoint (`kvtier_retention_*`) and by vLLM's metrics
(`vllm:kvtier_retention_*`). Before, vLLM's lacked `budget_blocks` (README lists the budget)."""

from __future__ import annotations

from kvtier.control.retention import Retention
from kvtier.integrations.vllm.retention_metrics import (
    PREFIX,
    RETENTION_COUNTERS,
    RETENTION_GAUGES,
    record_retention,
    retention_metric_definitions,
)
from kvtier.standalone.metrics import RETENTION_HELP


class Stats:
    """vLLM's metrics collector, as `record_retention` uses it."""

    def __init__(self):
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}

    def increase_counter(self, name: str, delta: float) -> None:
        self.counters[name] = self.counters.get(name, 0) + delta

    def set_gauge(self, name: str, value: float) -> None:
        self.gauges[name] = value


def test_every_retention_number_is_served_standalone_and_under_vllm():
    report = Retention(capacity=64).report()
    assert set(report) == set(RETENTION_HELP) == set(RETENTION_COUNTERS) | set(RETENTION_GAUGES)
    assert set(retention_metric_definitions()) == {PREFIX + name for name in report}
    stats = record_retention(Stats(), report, {})
    assert stats.gauges[PREFIX + "budget_blocks"] == report["budget_blocks"] == 32
