"""Cost of a refused or small eviction next to many pinned blocks (issue 19 item 2).

    python -m benchmarks.control_plane [--pinned 0,100k,1M] [--json FILE]

For every policy (and a seed-contract policy completed by `KeyIndex`) and every number P of
pinned blocks, one policy instance holds P pinned blocks (the oldest, as a long prefill or a
slow copy would leave them) and then:

- `refused`: 3 evictable blocks, `evict(4)`: must return None;
- `small`: 1000 evictable blocks, `evict(4)` followed by inserting 4 new evictable blocks.

Each is measured *before* (the policy without evictable accounting: no notice yet) and *after*
(the block table's first `evictable` notice on the same instance, as every tier sends it), in
the same run. Cost is CPU time (`time.process_time`) per call, the mean over all calls, so that
other processes on the machine do not inflate it. The first call after that notice is reported
apart (`first_call_us`): LRU sets the pinned blocks met at its head aside once there.

This is a benchmark, not a test: it prints rows and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.seed_lru import SeedLRU
from kvtier.bench.provenance import provenance
from kvtier.core.keys import make_offload_key
from kvtier.core.types import BlockStatus
from kvtier.policies.base import CachePolicy, with_key_index
from kvtier.transfer import registry

POLICIES = ("lru", "arc", "sieve", "prefix-freq", "seed-lru")
BUDGET_S = 0.3  # CPU seconds spent measuring one (policy, P, case, mode); at least 3 calls


def _key(i: int):
    return make_offload_key(i.to_bytes(8, "big"), 0)


def _make(policy: str, capacity: int) -> CachePolicy:
    if policy == "seed-lru":
        return with_key_index(SeedLRU(capacity))
    return with_key_index(registry.resolve(registry.POLICIES, policy)(capacity))


def _fill(policy: CachePolicy, start: int, count: int, ref_cnt: int) -> None:
    keys = [_key(i) for i in range(start, start + count)]
    blocks = BlockStatus.many(range(start, start + count))
    for block in blocks:
        block.ref_cnt = ref_cnt
    policy.insert_many(keys, blocks)


def _per_call(call: Callable[[], None], budget: float = BUDGET_S) -> tuple[float, int]:
    """Mean CPU microseconds of one `call` (all calls made, so amortised work such as LRU's
    occasional pass over its aside blocks is included), and the number of calls made."""
    calls = 0
    spent = 0.0
    batch = 1
    while spent < budget or calls < 3:
        t0 = time.process_time()
        for _ in range(batch):
            call()
        dt = time.process_time() - t0
        calls += batch
        spent += dt
        if dt < 0.01:
            batch *= 2  # keep the clock reads rare
    return spent / calls * 1e6, calls


def measure(policy_name: str, pinned: int, case: str) -> dict[str, Any]:
    """One row: before/after CPU µs per call of `case` ('refused' or 'small') with `pinned` pinned."""
    free = 3 if case == "refused" else 1000
    policy = _make(policy_name, pinned + free + 8)
    _fill(policy, 0, pinned, 1)
    _fill(policy, pinned, free, 0)
    next_id = [pinned + free]

    def refused() -> None:
        assert policy.evict(4, set()) is None

    def small() -> None:
        victims = policy.evict(4, set())
        assert victims is not None and len(victims) == 4
        _fill(policy, next_id[0], 4, 0)
        next_id[0] += 4

    call = refused if case == "refused" else small
    before, before_calls = _per_call(call)
    t0 = time.process_time()
    policy.evictable((), False)
    track_us = (time.process_time() - t0) * 1e6
    t0 = time.process_time()
    call()
    first_us = (time.process_time() - t0) * 1e6
    after, after_calls = _per_call(call)
    return {"policy": policy_name, "pinned": pinned, "case": case, "before_us": before, "after_us": after,
            "first_call_us": first_us, "first_notice_us": track_us, "calls": [before_calls, after_calls]}


def _count(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pinned", default="0,100k,1M", help="numbers of pinned blocks, e.g. 0,100k,1M")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--cases", default="refused,small")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'policy':<12}{'case':<9}{'pinned':>9}{'before us':>12}{'after us':>11}{'first call us':>15}")
    for policy in args.policies.split(","):
        for case in args.cases.split(","):
            for pinned in map(_count, args.pinned.split(",")):
                row = measure(policy, pinned, case)
                rows.append(row)
                print(f"{policy:<12}{case:<9}{pinned:>9,}{row['before_us']:>12,.1f}{row['after_us']:>11,.1f}"
                      f"{row['first_call_us']:>15,.1f}", flush=True)
    if args.json:
        doc = {"schema": "kvtier.bench.control_plane/1", **provenance(),
               "unit": "CPU microseconds per evict call (time.process_time, mean over all calls)", "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
