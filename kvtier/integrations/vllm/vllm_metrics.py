"""vLLM's own `vllm:kv_offload_*` metric names, exported by kvtier beside its `vllm:kvtier_*` ones.

An operator's dashboards for vLLM's `CPUOffloadingSpec` / `TieringOffloadingSpec` read these
names; kvtier fills them with the same meaning, from its own state:

* `vllm:kv_offload_cpu_cache_usage_perc`: share of the first (CPU) tier's capacity that cannot be
  evicted now (blocks being written, or pinned by loads, promotions or copies down);
* `vllm:kv_offload_cpu_cache_write_usage_perc`: share taken by the engine's stores in flight
  (prepared, not completed);
* `vllm:kv_offload_cpu_cache_read_usage_perc`: the first minus the second (never below 0), as
  vLLM computes it;
* `vllm:kv_offload_cpu_allocation_size`: histogram of the blocks allocated by each
  `prepare_store` that allocated any;
* `vllm:kv_offload_stores_skipped`: store candidates skipped by the store threshold
  (`kvtier.control.store_threshold`; reported only when it is on, as vLLM does);
* `vllm:kv_offload_tiering_read_bytes` / `_read_time` `{tier}`: bytes / seconds read from each
  lower tier (promotions into the CPU tier);
* `vllm:kv_offload_tiering_write_bytes` / `_write_time` `{tier}`: bytes / seconds written into
  each lower tier (cascade copies).

vLLM's connector-level names (`vllm:kv_offload_load_bytes`, `_store_bytes`, `_lookup_*`, ...) are
the connector's own and are exported whatever the spec. Not exported: the tiering lookup, failure
and job gauges (kvtier counts those
per tier under its own names: `vllm:kvtier_failures`, `_probe_*`, ...). In a chain of more than two
tiers, a middle tier's read bytes also count its copies further down, and the last tier's write
bytes come from the tier above it rather than from the CPU tier (vLLM's secondary tiers all hang off
the CPU tier).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

CPU_USAGE = "vllm:kv_offload_cpu_cache_usage_perc"
CPU_WRITE_USAGE = "vllm:kv_offload_cpu_cache_write_usage_perc"
CPU_READ_USAGE = "vllm:kv_offload_cpu_cache_read_usage_perc"
CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
TIER_READ_TIME = "vllm:kv_offload_tiering_read_time"
TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
TIER_WRITE_TIME = "vllm:kv_offload_tiering_write_time"
# Blocks per prepare_store: the buckets vLLM's CPU spec uses, so that both histograms line up.
ALLOCATION_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
# vLLM's tiering counter -> the kvtier TierStats counter of a lower tier that has its meaning.
TIER_COUNTERS = {TIER_READ_BYTES: "bytes_out", TIER_READ_TIME: "seconds_out",
                 TIER_WRITE_BYTES: "bytes_in", TIER_WRITE_TIME: "seconds_in"}


def vllm_metric_definitions(stores_skipped: bool = False) -> dict[str, OffloadingMetricMetadata]:
    """The Prometheus definitions of vLLM's names that kvtier fills (see the module docstring);
    `vllm:kv_offload_stores_skipped` only with `stores_skipped` (a store threshold is on)."""
    defs: dict[str, OffloadingMetricMetadata] = {
        CPU_USAGE: OffloadingGaugeMetadata(documentation=(
            "kvtier: fraction of the CPU tier's blocks that cannot be evicted now (being written, or "
            "pinned by loads, promotions or copies to a lower tier).")),
        CPU_WRITE_USAGE: OffloadingGaugeMetadata(documentation=(
            "kvtier: fraction of the CPU tier's blocks being stored by the engine (store not completed).")),
        CPU_READ_USAGE: OffloadingGaugeMetadata(documentation=(
            "kvtier: cpu_cache_usage_perc minus cpu_cache_write_usage_perc (blocks pinned by reads).")),
        CPU_ALLOCATION_SIZE: OffloadingHistogramMetadata(
            documentation="kvtier: CPU-tier blocks allocated by each prepare_store call that allocated any.",
            buckets=ALLOCATION_BUCKETS),
    }
    if stores_skipped:
        defs[STORES_SKIPPED] = OffloadingCounterMetadata(documentation=(
            "kvtier: blocks not stored because they were offered fewer than store_threshold times."))
    docs = {TIER_READ_BYTES: "Bytes read from this lower tier by promotions into the CPU tier.",
            TIER_READ_TIME: "Seconds spent reading from this lower tier.",
            TIER_WRITE_BYTES: "Bytes written into this lower tier by cascade copies.",
            TIER_WRITE_TIME: "Seconds spent writing into this lower tier."}
    for name, doc in docs.items():
        defs[name] = OffloadingCounterMetadata(documentation=f"kvtier: {doc}", labelnames=("tier",))
    return defs


def first_tier_usage(tier: Any, storing: int) -> tuple[float, float, float]:
    """`(usage, write usage, read usage)` of the first tier, as fractions of its capacity.

    `storing`: blocks the engine is storing (prepared, not completed). Usage counts the blocks that
    cannot be evicted now: O(1) where the policy tracks pins (`evictable_count`); a policy that
    does not is reported as `storing` only (usage = write usage)."""
    capacity = tier.capacity
    if not capacity:
        return 0.0, 0.0, 0.0
    evictable = tier.table.evictable_count()
    busy = storing if evictable is None else max(len(tier.policy) - evictable, storing)
    usage, write = busy / capacity, storing / capacity
    return usage, write, max(usage - write, 0.0)


def record_first_tier(stats: Any, tier: Any, storing: int, allocation_sizes: list[int]) -> None:
    """Set the CPU-tier gauges and histogram observations on `stats` (an `OffloadingConnectorStats`)."""
    usage, write, read = first_tier_usage(tier, storing)
    stats.set_gauge(CPU_USAGE, usage)
    stats.set_gauge(CPU_WRITE_USAGE, write)
    stats.set_gauge(CPU_READ_USAGE, read)
    for size in allocation_sizes:
        stats.observe_histogram(CPU_ALLOCATION_SIZE, size)


def record_lower_tier(stats: Any, tier_name: str, deltas: dict[str, float]) -> None:
    """Add a lower tier's read and write counters (changes since the last call) to `stats`."""
    for name, counter in TIER_COUNTERS.items():
        delta = deltas.get(counter, 0)
        if delta:
            stats.increase_counter(name, delta, (tier_name,))
