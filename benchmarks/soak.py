"""Soak test of the hierarchy manager: a million operations with failing handlers and aborted requests.

    python -m benchmarks.soak --ops 1000000 [--seed 0] [--json FILE]

Two memory tiers (`hot` cascading `on_evict` into `warm`, real bytes derived from keys) under a
`ChaosHandler` that completes each copy at once, later (deferred to a random later step, so
demotions and promotions stay in flight while the driver goes on) or fails it (raising in `submit`,
or after scribbling garbage into the destination slots). The driver calls the manager the way an
engine does, with aborts: stores prepared and completed much later or with `success=False`
(after writing garbage), loads prepared and completed later or "aborted" (complete_load without
reading), lookups answered RETRY whose promotion may fail, touches, schedule ends.

An *operation* is one call into the manager (lookup, prepare_load, complete_load, prepare_store,
complete_store, touch, on_schedule_end). Checked after every operation: no tier holds more blocks
than its capacity. Checked every `--check-every` operations and at the end (`check_invariants`):
- every tier's resident blocks occupy distinct slots and `resident + free == capacity`;
- every readable block (ref_cnt >= 0), in every tier, holds exactly the bytes of its key;
- blocks pinned by the driver's open loads are still resident, the same block, ref_cnt >= 1;
- a tier's clean keys are resident there and readable one tier down;
- ref_cnt is never below -1, and -1 only for blocks being written.
At the end every open request is finished, every deferred job runs, and no block may stay pinned.

Exit status 1 if an invariant failed (the message says which, at which operation).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import time
from collections import Counter
from typing import Any

from kvtier.bench.provenance import provenance
from kvtier.bench.quiet import logger_at
from kvtier.core.types import LookupResult, TransferResult
from kvtier.transfer.handlers.base import TransferHandler

BLOCK_BYTES = 64


class InvariantError(AssertionError):
    pass


def payload(key: bytes) -> bytes:
    return hashlib.blake2b(bytes(key), digest_size=BLOCK_BYTES).digest()


class ChaosHandler(TransferHandler):
    """Copies between memory tiers at once, later, or not at all (failure)."""

    def __init__(self, backends: dict, rng: random.Random, p_raise: float = 0.02, p_fail: float = 0.05,
                 p_defer: float = 0.4):
        super().__init__()
        self.backends, self.rng = backends, rng
        self.p_raise, self.p_fail, self.p_defer = p_raise, p_fail, p_defer
        self.queue: list[tuple[int, Any, Any]] = []
        self.counts: Counter = Counter()

    def submit(self, job_id, src, dst) -> None:
        r = self.rng.random()
        if r < self.p_raise:
            self.counts["raised"] += 1
            raise OSError(5, "injected EIO in submit")
        if r < self.p_raise + self.p_defer:
            self.counts["deferred"] += 1
            self.queue.append((job_id, src, dst))
            return
        self._finish(job_id, src, dst)

    def _finish(self, job_id, src, dst) -> None:
        s, d = self.backends[src.tier], self.backends[dst.tier]
        if self.rng.random() < self.p_fail:
            self.counts["failed"] += 1
            for b in dst.block_ids[: self.rng.randint(0, len(dst.block_ids))]:
                d.view(b)[:] = b"\xa5" * BLOCK_BYTES  # a partial, garbage write
            self._on_done(TransferResult(job_id, False, 0, 0.0, error="injected failure"))
            return
        for a, b in zip(src.block_ids, dst.block_ids):
            d.view(b)[:] = s.view(a)
        self.counts["copied"] += 1
        self._on_done(TransferResult(job_id, True, len(src.block_ids) * BLOCK_BYTES, 0.0))

    def step(self, fraction: float = 0.5) -> None:
        """Finish a random part of the deferred jobs."""
        if not self.queue:
            return
        keep = []
        for job in self.queue:
            (keep.append(job) if self.rng.random() > fraction else self._finish(*job))
        self.queue = keep

    def wait(self, job_ids) -> None:
        wanted = set(job_ids)
        jobs = [j for j in self.queue if j[0] in wanted]
        self.queue = [j for j in self.queue if j[0] not in wanted]
        for job in jobs:
            self._finish(*job)


def build(hot: int, warm: int, hot_policy: str, warm_policy: str, reserve: float):
    from kvtier import build_hierarchy, load_config_text

    text = f"""
block_bytes: {BLOCK_BYTES}B
tiers:
  - {{name: hot, backend: memory, capacity: {hot} blocks, policy: {hot_policy}, cascade: on_evict, reserve: {reserve}}}
  - {{name: warm, backend: memory, capacity: {warm} blocks, policy: {warm_policy}}}
"""
    return build_hierarchy(load_config_text(text))


def check_invariants(mgr, open_loads: list, where: str) -> None:
    def fail(msg: str) -> None:
        raise InvariantError(f"{where}: {msg}")

    tiers = mgr.tiers
    for i, tier in enumerate(tiers):
        pol, backend = tier.policy, tier.backend
        resident = len(pol)
        if resident > tier.capacity:
            fail(f"tier {tier.name} holds {resident} blocks, capacity {tier.capacity}")
        if resident + backend.get_num_free_blocks() != tier.capacity:
            fail(f"tier {tier.name}: {resident} resident + {backend.get_num_free_blocks()} free != {tier.capacity}")
        slots = set()
        for key in list(pol.keys()):
            block = pol.get(key)
            if block.block_id in slots:
                fail(f"tier {tier.name}: slot {block.block_id} used twice")
            slots.add(block.block_id)
            if block.ref_cnt < -1:
                fail(f"tier {tier.name}: ref_cnt {block.ref_cnt}")
            if block.ref_cnt >= 0 and bytes(backend.view(block.block_id)) != payload(key):
                fail(f"tier {tier.name}: readable block {bytes(key).hex()} holds wrong bytes")
        if i + 1 < len(tiers):
            below = tiers[i + 1].policy
            for key in tier.clean:
                if pol.get(key) is None:
                    fail(f"tier {tier.name}: clean key {bytes(key).hex()} is not resident")
                b = below.get(key)
                if b is None or b.ref_cnt < 0:
                    fail(f"tier {tier.name}: clean key {bytes(key).hex()} is not readable in {tiers[i + 1].name}")
    for key, tier_index, block in open_loads:
        tier = tiers[tier_index]
        held = tier.policy.get(key)  # (compiled policies answer with views: compared by slot)
        if held is None or held.block_id != block.block_id or held.ref_cnt < 1:
            fail(f"pinned block {bytes(key).hex()} of tier {tier.name} was evicted or unpinned")


class SoakDriver:
    """Calls the manager of a two-tier hierarchy the way an engine does, with aborts, counting
    every call (`op`) and checking the invariants as it goes. `store_while_promoting`: see `run`."""

    def __init__(self, h, rng: random.Random, chaos: ChaosHandler, universe: int, check_every: int,
                 progress=None, store_while_promoting: bool = True) -> None:
        from kvtier import ReqContext, make_offload_key

        self.h, self.mgr, self.rng, self.chaos = h, h.manager, rng, chaos
        self.hot_backend = h.backends["hot"]
        self.top_policy = self.mgr.tiers[0].policy
        self.capacities = [(t.policy, t.capacity, t.name) for t in self.mgr.tiers]
        self.keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(universe)]
        self.weights = [1.0 / (1 + i) ** 0.8 for i in range(universe)]  # skewed popularity
        self.ctx = ReqContext("soak")
        self.check_every, self.progress, self.store_while_promoting = check_every, progress, store_while_promoting
        self.counts: Counter = Counter()
        self.open_stores: list[list] = []  # keys prepared, not completed yet
        self.open_loads: list[tuple] = []  # (key, tier index, block) prepared, not completed yet
        self.n = 0  # operations so far

    def op(self, name: str) -> None:
        """Count one call into the manager; check capacities now and the invariants every `check_every`."""
        self.n += 1
        n = self.n
        self.counts[name] += 1
        for pol, cap, tname in self.capacities:
            if len(pol) > cap:
                raise InvariantError(f"op {n} ({name}): tier {tname} holds {len(pol)} blocks > {cap}")
        if n % self.check_every == 0:
            check_invariants(self.mgr, self.open_loads, f"op {n} ({name})")
        if self.progress is not None and n % 100_000 == 0:
            self.progress(n)

    def finish_load(self, index: int) -> None:
        key, _tier, _block = self.open_loads.pop(index)
        self.mgr.complete_load([key], self.ctx)
        self.op("complete_load")

    def finish_store(self, index: int, success: bool) -> None:
        batch = self.open_stores.pop(index)
        if not success:  # an aborted request: garbage in its slots, then success=False
            for key in batch:
                block = self.top_policy.get(key)
                if block is not None and block.ref_cnt == -1:
                    self.hot_backend.view(block.block_id)[:] = b"\x5a" * BLOCK_BYTES
            self.counts["stores_aborted"] += len(batch)
        self.mgr.complete_store(batch, self.ctx, success=success)
        self.op("complete_store")

    def request(self) -> None:
        """A request: look its blocks up in order, load the hits, store the rest."""
        mgr, rng, ctx = self.mgr, self.rng, self.ctx
        req = list(dict.fromkeys(rng.choices(self.keys, self.weights, k=rng.randint(1, 4))))
        hits = []
        for key in req:
            answer = mgr.lookup(key, ctx)
            self.op("lookup")
            self.counts[f"lookup_{answer.name}"] += 1
            if answer is not LookupResult.HIT:
                break
            hits.append(key)
        if hits and rng.random() < 0.9:
            self.load(hits)
        rest = [k for k in req if k not in hits]
        if not self.store_while_promoting:
            skipped = [k for k in rest if k in mgr._promotions.running and self.top_policy.get(k) is None]
            if skipped:
                self.counts["stores_skipped_promotion_queued"] += len(skipped)
                rest = [k for k in rest if k not in skipped]
        if rest and answer is LookupResult.MISS and len(self.open_stores) < 4:
            out = mgr.prepare_store(rest, ctx)
            self.op("prepare_store")
            if out is None:
                self.counts["stores_refused"] += 1
            elif out.keys_to_store:
                for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
                    self.hot_backend.view(slot)[:] = payload(key)
                self.open_stores.append(list(out.keys_to_store))

    def load(self, hits: list) -> None:
        """Prepare a load of `hits` (checking the bytes it points at) and touch them; the load stays open."""
        spec = self.mgr.prepare_load(hits, self.ctx)
        self.op("prepare_load")
        for key, slot in zip(hits, spec.block_ids):
            block = self.top_policy.get(key)
            if bytes(self.hot_backend.view(slot)) != payload(key):
                raise InvariantError(f"op {self.n}: prepare_load of {bytes(key).hex()} points at wrong bytes")
            self.open_loads.append((key, 0, block))
        self.mgr.touch(hits, self.ctx)
        self.op("touch")

    def step(self) -> None:
        """One random move: a request, finishing a store or a load, or a schedule end."""
        rng = self.rng
        r = rng.random()
        if r < 0.40:
            self.request()
        elif r < 0.55 and self.open_stores:
            self.finish_store(rng.randrange(len(self.open_stores)), success=rng.random() > 0.1)
        elif r < 0.70 and self.open_loads:  # finished or aborted: both end with complete_load
            self.counts["loads_aborted" if rng.random() < 0.2 else "loads_done"] += 1
            self.finish_load(rng.randrange(len(self.open_loads)))
        else:
            self.chaos.step(rng.random() if r < 0.85 else 0.3)
            self.mgr.on_schedule_end()
            self.op("on_schedule_end")

    def teardown(self) -> None:
        """Finish every request, run every deferred job; then nothing may stay pinned or in flight."""
        mgr = self.mgr
        check_invariants(mgr, self.open_loads, "before teardown")
        while self.open_loads:
            self.finish_load(len(self.open_loads) - 1)
        while self.open_stores:
            self.finish_store(len(self.open_stores) - 1, success=self.rng.random() < 0.5)
        mgr.wait_idle()
        mgr.on_schedule_end()
        mgr.wait_idle()
        check_invariants(mgr, [], "after teardown")
        pins = [(t.name, bytes(k).hex(), t.policy.get(k).ref_cnt) for t in mgr.tiers for k in t.policy.keys()
                if t.policy.get(k).ref_cnt != 0]
        if pins or mgr.has_pending_work() or any(t.demoting for t in mgr.tiers):
            raise InvariantError(f"after teardown: blocks still pinned or in flight: {pins[:10]}, "
                                 f"pending work={mgr.has_pending_work()}")


@logger_at("kvtier.transfer.router", logging.ERROR)  # injected failures are expected
def run(ops: int, seed: int = 0, hot: int = 16, warm: int = 48, universe: int = 160, check_every: int = 64,
        hot_policy: str = "arc", warm_policy: str = "lru", reserve: float = 0.25, progress=None,
        store_while_promoting: bool = True) -> dict:
    """`store_while_promoting=False` keeps the driver from storing a block whose promotion is queued
    (lookup answered RETRY and no schedule end ran since), a path where the manager leaves the
    stored block at ref_cnt -1 forever (docs/reliability.md, bug 1).

    Raises InvariantError naming the operation at which an invariant failed or the manager raised."""
    from kvtier import CPULoadStoreSpec

    rng = random.Random(seed)
    h = build(hot, warm, hot_policy, warm_policy, reserve)
    chaos = ChaosHandler(h.backends, rng)
    h.router.register(CPULoadStoreSpec, CPULoadStoreSpec, chaos)
    driver = SoakDriver(h, rng, chaos, universe, check_every, progress, store_while_promoting)
    started = time.perf_counter()
    try:
        while driver.n < ops:
            driver.step()
        elapsed = time.perf_counter() - started
        driver.teardown()
    except InvariantError:
        raise
    except Exception as exc:
        raise InvariantError(f"op {driver.n}: the manager raised {type(exc).__name__}: {exc}") from exc
    stats = h.manager.get_stats()
    h.close()
    return {"schema": "kvtier.soak/1", "ops": driver.n, "seed": seed, "seconds": round(elapsed, 2),
            "ops_per_s": round(driver.n / elapsed), "tiers": {"hot": hot, "warm": warm, "universe": universe,
                                                              "hot_policy": hot_policy, "warm_policy": warm_policy},
            "check_every": check_every, "store_while_promoting": store_while_promoting,
            "counts": dict(sorted(driver.counts.items())),
            "handler": dict(chaos.counts), "stats": stats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=64)
    p.add_argument("--hot-policy", default="arc")
    p.add_argument("--skip-stores-while-promoting", action="store_true",
                   help="never store a block whose promotion is queued (the path of bug 1, docs/reliability.md)")
    p.add_argument("--json", help="write the report as JSON")
    args = p.parse_args(argv)
    try:
        report = run(args.ops, args.seed, check_every=args.check_every, hot_policy=args.hot_policy,
                     progress=lambda i: print(f"  {i:,} ops", flush=True),
                     store_while_promoting=not args.skip_stores_while_promoting)
    except InvariantError as exc:
        print(f"INVARIANT FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"{report['ops']:,} manager operations in {report['seconds']} s: {report['ops_per_s']:,} ops/s "
          f"(invariants checked every {report['check_every']} ops and at the end)")
    for k, v in report["counts"].items():
        print(f"  {k:<22}{v:>12,}")
    print("  handler: " + ", ".join(f"{k} {v:,}" for k, v in sorted(report["handler"].items())))
    for name, s in report["stats"].items():
        print(f"  tier {name}: " + ", ".join(f"{k} {s[k]:,}" for k in ("stores", "evictions", "demotions",
                                                                         "promotions", "cascade_dropped",
                                                                         "cascade_deferred", "failures")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**provenance(), **report}, f, indent=1)
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
