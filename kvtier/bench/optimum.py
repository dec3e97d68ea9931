"""The offline hit-rate ceiling of a prefix-cache trace (Belady's MIN adapted to prefix hits).

`kvtier bench trace` reports it beside each policy's hit rate at every swept capacity, and the policy
study (`python -m benchmarks.policy_study`) draws it as the ceiling.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from kvtier.bench.workloads import Trace, leading_hits


def next_uses(requests: list[list[int]], never: int) -> list[list[int]]:
    """`out[i][j]`: the index of the next request that uses `requests[i][j]` (`never` if none)."""
    out: list[list[int]] = [[]] * len(requests)
    upcoming: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        row = requests[i]
        out[i] = [upcoming.get(h, never) for h in row]
        for h in row:
            upcoming[h] = i
    return out


def optimum(trace: Trace, capacity: int | None) -> float:
    """Offline hit-rate ceiling at `capacity` blocks (None: unlimited space).

    Belady's MIN for this workload: after each request, every block of the request is a candidate
    to stay; when the cache exceeds `capacity`, drop the block whose next use is furthest away
    (never used again first), deeper blocks first on ties. A block's next use is never earlier
    than its parent's (a request holding a block holds its whole prefix), so the cache stays
    prefix-closed and block hits equal prefix hits. Storing is optional here (a block whose next
    use is furthest is simply not kept), so this bounds every demand policy from above.
    """
    requests = trace.requests
    total = trace.total_blocks
    if capacity is None:
        return trace.optimum_hit_rate()
    inf = len(requests) + 1
    next_use = next_uses(requests, inf)
    cached: dict[int, tuple[int, int]] = {}  # hash -> (next use, depth) as currently keyed in the heap
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, hash): furthest next use on top
    hits = 0
    for i, row in enumerate(requests):
        hits += leading_hits(row, cached)
        for depth, (h, nxt) in enumerate(zip(row, next_use[i])):
            entry = (nxt, depth)
            cached[h] = entry
            heapq.heappush(heap, (-nxt, -depth, h))
        while len(cached) > capacity:
            neg_nxt, neg_depth, h = heapq.heappop(heap)
            if cached.get(h) == (-neg_nxt, -neg_depth):
                del cached[h]
        if len(heap) > 4 * capacity + 1024:  # drop stale heap entries now and then
            heap = [(-n, -d, h) for h, (n, d) in cached.items()]
            heapq.heapify(heap)
    return hits / max(1, total)


def ends_known(trace: Trace, capacity: int) -> float:
    """The hit rate of an LRU that knows exactly which blocks are never used again and evicts
    those first (a request's blocks inserted tail first, as kvtier's stores do): the most that
    `session_ended` hints can buy an LRU, whatever a policy does with them. What stays between
    this and `optimum` is the timing of live sessions' next turns, which no hint carries."""
    requests = trace.requests
    inf = len(requests)
    next_use = next_uses(requests, inf)
    recency: OrderedDict[int, None] = OrderedDict()  # least recent first
    dead: OrderedDict[int, None] = OrderedDict()  # resident, never used again: first out
    hits = 0
    for i, row in enumerate(requests):
        hits += leading_hits(row, recency)
        for h, nxt in zip(reversed(row), reversed(next_use[i])):  # the request's head ends most recent
            recency[h] = None
            recency.move_to_end(h)
            if nxt == inf:
                dead[h] = None
        while len(recency) > capacity:
            victim = dead.popitem(last=False)[0] if dead else recency.popitem(last=False)[0]
            recency.pop(victim, None)
    return hits / max(1, trace.total_blocks)
