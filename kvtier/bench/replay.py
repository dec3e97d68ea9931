"""Trace replay: drive an `OffloadingManager` the way vLLM's scheduler does, one request at a time.

Per request: look keys up in prefix order until the first miss (RETRY/HIT_PENDING answers make the
scheduler ask again on the next step, as vLLM does), load and touch the hits, store the rest,
finish the request, end the step. (vLLM's own managers get no `touch`: they apply a request's
recency when it finishes; kvtier inserts a request's new blocks tail first, which yields the same
recency order.) Transfers complete at once without bytes (`dry_run`
hierarchies): the replay measures the control plane — hit rates and manager block operations per
second — not bandwidth.

A *block operation* is one key passed to `lookup`, `prepare_load` or `prepare_store`; the same
driver counts them for every manager, so rates are comparable.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Sequence
from decimal import ROUND_FLOOR, Decimal
from typing import Any

from kvtier.bench.workloads import Trace
from kvtier.core.errors import KVTierError
from kvtier.core.keys import make_offload_key
from kvtier.core.types import LookupResult, ReqContext

MAX_RETRY_STEPS = 64  # a lookup still answering RETRY after this many steps counts as a miss


class ReplayCapacityError(KVTierError):
    """A swept capacity that a policy cannot hold (past its own limit, or more memory than there is)."""


def _keys_for(trace: Trace) -> list[list[bytes]]:
    cache: dict[int, bytes] = {}
    out = []
    for hashes in trace.requests:
        row = []
        for h in hashes:
            key = cache.get(h)
            if key is None:
                key = cache[h] = make_offload_key(h.to_bytes(8, "big"), 0)
            row.append(key)
        out.append(row)
    return out


def _lookup_round(lookup: Callable, lookup_run: Callable | None, keys: list, ctx: Any, HIT: object,
                  MISS: object) -> tuple[int, bool, int]:
    """One scheduler step's lookups of a request, as vLLM's scheduler makes them: key by key
    until a MISS, going on past a RETRY or HIT_PENDING (the request then waits a step). Returns
    (HITs counted, whether the request waits, lookups made). With `lookup_run` (kvtier's bulk
    call) the leading HITs take one call; the keys after a RETRY / HIT_PENDING are looked up
    one by one as before, so the answers and side effects are the same."""
    n_hit = looked = 0
    if lookup_run is not None:
        n_hit, result = lookup_run(keys, ctx)
        looked = n_hit + (result is not None)
        if result is None or result is MISS:
            return n_hit, False, looked
        keys = keys[looked:]
        deferred = True
    else:
        deferred = False
    for key in keys:
        looked += 1
        result = lookup(key, ctx)
        if result is HIT:
            n_hit += 1
        elif result is MISS:
            break
        else:  # RETRY or HIT_PENDING: the scheduler asks again next step
            deferred = True
    return n_hit, deferred, looked


def replay_manager(manager: Any, trace: Trace, *, vllm_api: bool = False, context_factory: Callable | None = None,
                   step_context: Any = None, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Replay `trace` through `manager`; returns hit counts, block ops, the elapsed time and the
    CPU time of this process (`cpu_seconds`, `cpu_us_per_block` per trace block: what the
    scheduler thread pays, and unlike wall time not inflated by other processes on the machine).

    `vllm_api` drives vLLM's own managers as its connector does (no `touch`; recency is applied
    in `on_request_finished`); `context_factory(req_id)` builds their request contexts.
    """
    keys_per_request = _keys_for(trace)
    make_ctx = context_factory or ReqContext
    HIT: object = LookupResult.HIT
    MISS: object = LookupResult.MISS
    if vllm_api:
        from vllm.v1.kv_offload.base import LookupResult as VLookup  # only with --compare vllm

        HIT, MISS = VLookup.HIT, VLookup.MISS
    gc.collect()  # (every run starts alike: what earlier runs left is not scanned by this one's collections)
    gc.freeze()
    try:
        start = time.perf_counter()
        cpu_start = time.process_time()
        ops, hits, stores_refused, retry_steps = drive(manager, keys_per_request, vllm_api, make_ctx, step_context,
                                                       HIT, MISS, progress)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    finally:
        gc.unfreeze()
    if progress is not None:
        progress(len(keys_per_request), len(keys_per_request))
    total = trace.total_blocks
    return {
        "requests": len(keys_per_request), "blocks": total, "hit_blocks": hits, "hit_rate": hits / max(1, total),
        "block_ops": ops, "seconds": elapsed, "block_ops_per_s": ops / elapsed if elapsed > 0 else 0.0,
        "cpu_seconds": cpu, "cpu_us_per_block": cpu * 1e6 / max(1, total),
        "retry_steps": retry_steps, "stores_refused": stores_refused,
    }


def drive(manager: Any, keys_per_request: list[list[bytes]], vllm_api: bool, make_ctx: Callable, step_context: Any,
          HIT: object, MISS: object, progress: Callable[[int, int], None] | None) -> tuple[int, int, int, int]:
    """The timed part of `replay_manager`: every request's scheduler cycle. Returns (block ops,
    hit blocks, stores refused, retry steps). A module attribute, so that an instruction count
    (`python -m benchmarks.cycle --callgrind`) can wrap exactly this."""
    lookup, prepare_load, complete_load = manager.lookup, manager.prepare_load, manager.complete_load
    prepare_store, complete_store, touch = manager.prepare_store, manager.complete_store, manager.touch
    lookup_run = None if vllm_api else getattr(manager, "lookup_run", None)
    ops = hits = stores_refused = retry_steps = 0
    report_every = max(1, len(keys_per_request) // 50)
    for i, keys in enumerate(keys_per_request):
        ctx = make_ctx(str(i))
        manager.on_new_request(ctx)
        for _ in range(MAX_RETRY_STEPS):
            n_hit, deferred, looked = _lookup_round(lookup, lookup_run, keys, ctx, HIT, MISS)
            ops += looked
            if not deferred:
                break
            retry_steps += 1
            manager.on_schedule_end(step_context)
        else:
            n_hit = 0
        if n_hit:
            hit_keys = keys[:n_hit]
            prepare_load(hit_keys, ctx)
            complete_load(hit_keys, ctx)
            if not vllm_api:
                touch(hit_keys, ctx)
            ops += n_hit
            hits += n_hit
        rest = keys[n_hit:]
        if rest:
            ops += len(rest)
            out = prepare_store(rest, ctx)
            if out is None:
                stores_refused += 1
            elif out.keys_to_store:
                complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        manager.on_schedule_end(step_context)
        if progress is not None and i % report_every == 0:
            progress(i + 1, len(keys_per_request))
    return ops, hits, stores_refused, retry_steps


def replay_kvtier(config: Any, trace: Trace, progress: Callable | None = None, hints: Any = None) -> dict[str, Any]:
    """Replay through a dry-run kvtier hierarchy built from `config`; adds per-tier figures. With
    `hints` (a `kvtier.bench.sessions.SessionHints`) each request carries its retention hint and
    the manager's retention runs on the trace's clock; the row adds the retention counters."""
    from kvtier.control.hierarchy import build_hierarchy

    try:
        hierarchy = build_hierarchy(config, dry_run=True)
    except KVTierError:
        raise
    except (ValueError, MemoryError) as exc:  # a policy's own limit (the compiled indexes: 2**30 blocks)
        tier = config.tiers[0]
        raise ReplayCapacityError(f"--capacities: tier '{tier.name}' of {tier.capacity.blocks:,} blocks with policy "
                                  f"'{tier.policy}' cannot be built ({type(exc).__name__}: {str(exc)[:200]}); give "
                                  f"a smaller capacity") from None
    try:
        if hints is not None:
            hierarchy.manager.retention.clock = hints.clock
        thresholded = Thresholded(hierarchy.manager, config.store_threshold) if config.store_threshold >= 2 else None
        result = replay_manager(thresholded or hierarchy.manager, trace, progress=progress,
                                context_factory=hints.context if hints is not None else None)
        if thresholded is not None:
            result["stores_skipped"] = thresholded.threshold.skipped
        stats = hierarchy.manager.get_stats()
        if hints is not None:
            result["retention"] = hierarchy.manager.retention.report()
    finally:
        hierarchy.close()
    total = max(1, result["blocks"])
    result["tiers"] = {
        name: {"hit_rate": s["hits"] / total, "hits": s["hits"], "evictions": s["evictions"],
               "demotions": s["demotions"], "promotions": s["promotions"], "cascade_dropped": s["cascade_dropped"],
               "capacity_blocks": s["capacity_blocks"], "policy": tier.policy}
        for (name, s), tier in zip(stats.items(), config.tiers)
    }
    return result


class Thresholded:
    """A `HierarchyManager` whose `prepare_store` first applies the config's `store_threshold`
    (`kvtier.control.store_threshold`), as kvtier's vLLM adapter does: the replay drives the
    manager itself, and a threshold left out would replay another cache than the config's."""

    def __init__(self, manager: Any, store_threshold: int) -> None:
        from kvtier.control.store_threshold import StoreThreshold

        self._manager = manager
        self.threshold: Any = StoreThreshold(store_threshold)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def prepare_store(self, keys: list[Any], req_context: Any = None) -> Any:
        manager = self._manager
        admitted = self.threshold.admit(keys, set(manager.stores.new_keys(keys)))
        return manager.prepare_store(admitted, req_context)


def replay_vllm(capacity_blocks: int, policy: str, trace: Trace, progress: Callable | None = None,
                store_threshold: int = 0) -> dict[str, Any]:
    """Replay through vLLM's own `CPUOffloadingManager` (requires vllm importable), with the
    config's `store_threshold` (vLLM's own: the same semantics as kvtier's)."""
    from vllm.v1.kv_offload.base import ReqContext as VReqContext
    from vllm.v1.kv_offload.base import ScheduleEndContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=capacity_blocks, cache_policy=policy,
                                   store_threshold=max(1, store_threshold))
    result = replay_manager(manager, trace, vllm_api=True, context_factory=lambda rid: VReqContext(req_id=rid),
                            step_context=ScheduleEndContext((), ()), progress=progress)
    result["tiers"] = {"cpu": {"hit_rate": result["hit_rate"], "capacity_blocks": capacity_blocks, "policy": policy}}
    return result


def vllm_available() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def parse_counts(text: str) -> list[int]:
    """"2k,10k,40000" -> [2000, 10000, 40000], each in [1, MAX_BLOCKS] (the config's limit on a
    tier's block count). Raises ValueError naming the bad item and the allowed range."""
    from kvtier.config import MAX_BLOCKS

    counts = []
    for given in text.split(","):
        given = given.strip()  # quoted as written in the messages below
        item = given.lower()
        if not item:
            continue
        scale = 1
        if item.endswith("k"):
            item, scale = item[:-1], 1000
        elif item.endswith("m"):
            item, scale = item[:-1], 1_000_000
        try:  # 'inf', 'nan', '1e400' are no count (as floats); then exactly ('1.001k': 1001, not 1000)
            exact = Decimal(MAX_BLOCKS + 1)
            if len(item) <= 24:
                int(float(item))
                exact = Decimal(item) * scale
        except (ValueError, ArithmeticError):  # OverflowError: 'inf', '1e400'; decimal.InvalidOperation
            raise ValueError(f"{given!r} is not a block count (write e.g. 2k,10k,40000)") from None
        if not 0 < exact <= MAX_BLOCKS:
            raise ValueError(f"{given} is out of range: a block count is from 1 to {MAX_BLOCKS:,} (the config's "
                             f"largest tier)")
        counts.append(_whole(given, exact, scale))
    if not counts:
        raise ValueError("no block counts given (write e.g. 2k,10k,40000)")
    return counts


def _whole(given: str, exact: Decimal, scale: int) -> int:
    """`exact`, refused unless a whole number of blocks once scaled ('1.9', '0.0005k': they were
    truncated before, '1.9' ran at 1 block); the message names the whole numbers next to it."""
    if exact == exact.to_integral_value():
        return int(exact)
    low = int(exact.to_integral_value(rounding=ROUND_FLOOR))
    near = " or ".join(f"{n:,}" for n in (low, low + 1) if n > 0)
    scaled = f" ({exact.normalize():g} blocks)" if scale != 1 else ""
    raise ValueError(f"{given!r} is not a whole number of blocks{scaled}: write {near}")


def sweep(config: Any, trace: Trace, capacities: Sequence[int] | None, policies: Iterable[str] | None = None,
          compare_vllm: bool = False, progress_factory: Callable[[str], Callable] | None = None,
          repeats: int = 1, hints: Callable[[], Any] | None = None, without_hints: bool = True) -> list[dict[str, Any]]:
    """Replay for every (first-tier capacity, policy); with `compare_vllm`, also vLLM's LRU and ARC
    at each capacity, with as many blocks as kvtier's tiers together (`total_blocks`; a row's
    `capacity_blocks` is the swept first-tier capacity it is compared at, `total_capacity_blocks`
    what it held in all), and each kvtier run gets its ratios to vLLM's LRU (`vs_vllm_lru`). With
    `hints` (a factory of fresh `SessionHints`), every policy is replayed with hints too (rows with
    `hints: true`); `without_hints=False` leaves out the runs without.

    With `repeats` > 1 the runs of one capacity are repeated in interleaved rounds and each keeps
    its round of least CPU time (hit rates do not change between rounds; on a noisy machine the
    cheapest round is the least disturbed one, and interleaving exposes every system to the same
    noise)."""
    rows = []
    for cap in (list(capacities) if capacities else [None]):
        base = config.with_capacities(cap) if cap is not None else config
        first_cap = base.tiers[0].capacity.blocks
        runs = _runs(base, trace, policies, compare_vllm, hints, without_hints)
        best: dict[tuple[str, str, bool], dict[str, Any]] = {}
        for round_ in range(max(1, repeats)):
            for system, policy, hinted, run in runs:
                label = (f"{system} {policy}{' +hints' if hinted else ''} @{first_cap}"
                         + (f" ({round_ + 1}/{repeats})" if repeats > 1 else ""))
                r = run(progress_factory(label) if progress_factory else None)
                key = (system, policy, hinted)
                if key not in best or r["cpu_seconds"] < best[key]["cpu_seconds"]:
                    best[key] = r
        vllm_rows = {p: best[("vllm", p, False)] for s, p, _, _ in runs if s == "vllm"}
        for system, policy, hinted, _ in runs:
            r = best[(system, policy, hinted)]
            r.update(system=system, policy=policy, hints=hinted, capacity_blocks=first_cap, rounds=max(1, repeats))
            r["total_capacity_blocks"] = sum(t["capacity_blocks"] for t in r["tiers"].values())
            if system == "kvtier":
                if "lru" in vllm_rows:
                    ref = vllm_rows["lru"]
                    better = max(vllm_rows.values(), key=lambda x: x["hit_rate"])
                    r["vs_vllm_lru"] = {"block_ops_per_s": r["block_ops_per_s"] / max(1e-9, ref["block_ops_per_s"]),
                                        "cpu_per_block": r["cpu_us_per_block"] / max(1e-9, ref["cpu_us_per_block"]),
                                        "hit_rate": r["hit_rate"] / max(1e-9, ref["hit_rate"])}
                    r["vs_vllm_best_hit_rate"] = r["hit_rate"] - better["hit_rate"]
            rows.append(r)
    return rows


def total_blocks(config: Any) -> int:
    """The blocks of every tier of `config` together: the capacity vLLM's manager (one tier) gets
    in `sweep`, so that both hold as many blocks (the optimum's capacity too)."""
    return sum(t.capacity.blocks for t in config.tiers)


def _runs(base: Any, trace: Trace, policies: Iterable[str] | None, compare_vllm: bool,
          hints: Callable[[], Any] | None, without_hints: bool) -> list[tuple[str, str, bool, Callable]]:
    """The runs of one capacity: (system, policy, hinted, run(progress) -> row)."""
    from dataclasses import replace

    from kvtier.config import TierConfig

    total = total_blocks(base)  # vLLM's one tier holds as many blocks as kvtier's tiers together
    runs: list[tuple[str, str, bool, Callable]] = []
    if compare_vllm:
        for vpolicy in ("lru", "arc"):
            runs.append(("vllm", vpolicy, False, lambda progress, p=vpolicy, c=total:
                         replay_vllm(c, p, trace, progress, base.store_threshold)))
    for policy in (list(policies) if policies else [base.tiers[0].policy]):
        tier0 = TierConfig(**{**base.tiers[0].__dict__, "policy": policy})
        cfg = replace(base, tiers=(tier0, *base.tiers[1:]))  # (its store_threshold too)
        if without_hints or hints is None:
            runs.append(("kvtier", policy, False, lambda progress, c=cfg: replay_kvtier(c, trace, progress)))
        if hints is not None:
            runs.append(("kvtier", policy, True,
                         lambda progress, c=cfg: replay_kvtier(c, trace, progress, hints())))
    return runs
