"""The eviction walk of the pure `prefix-freq` order (kvtier/policies/prefix_pure.py): the lanes'
heads, the tails taken first while they are one-time, the k-way merge of the segment lanes by
score, a run of victims taken from one lane while it stays below the other heads, and the
bookkeeping of the keys a run evicted; also `touch`'s probes. Module functions over the order's
structures, kept apart so that the order's module stays one readable size. A key may go when it is
neither pinned (`pinned`, the order's) nor protected."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from itertools import chain, islice
from operator import itemgetter
from typing import Any

from kvtier.core.keys import OffloadKey
from kvtier.policies.prefix_tails import EVICTED_NEW, EVICTED_TAIL

_first = itemgetter(0)
_second = itemgetter(1)
_TAIL = 0  # segment index of request tails; segment 1 + c holds the blocks with c hits
_INF = float("inf")


def _heads(order: Any, protected: Collection[OffloadKey], first: int,
           met: list[tuple[int, OffloadKey]] | None = None) -> list[list]:
    """The lanes of `order` (a `PurePrefixFreqOrder`): per non-empty segment from `first` on,
    [score of its first evictable key, key, iterator, offset, segment index, keys taken so far].
    Offset = credit * unit (tails: 0). The keys passed over (pinned, protected) are appended to
    `met` when it is given."""
    unit, credits, pinned = order.unit, order.credits, order.pinned
    lanes: list[list] = []
    segs = order.segs
    freed = order._aside.freed
    lane_of = order._aside.lane
    for index in range(first, len(segs)):
        if freed[index]:  # (a segment may hold only aside keys)
            it = lane_of(index, pinned)
        elif segs[index]:
            it = iter(segs[index].items())  # (`lane_of` when no key is aside)
        else:
            continue
        for key, stamp in it:
            if key not in pinned and key not in protected:
                offset = credits[index - 1] * unit if index else 0.0
                lanes.append([stamp + offset, key, it, offset, index, []])
                break
            if met is not None:
                met.append((index, key))
    return lanes


def _best_lane(lanes: list[list]) -> tuple[list, float]:
    """The lane whose head scores lowest (the first of equals: ties go to the lower segment),
    and the lowest score among the other lanes' heads (inf when there is none)."""
    best = lanes[0]
    limit = _INF
    for lane in lanes[1:]:
        score = lane[0]
        if score < best[0]:
            limit = best[0]
            best = lane
        elif score < limit:
            limit = score
    return best, limit


def _merged(lanes: list[list], pinned: set[OffloadKey], protected: Collection[OffloadKey]) -> Iterator[OffloadKey]:
    """The evictable keys of `lanes` (from `_heads`) by increasing score, ties to the lower
    segment: a k-way merge that compares only the lanes' heads. `evict` walks the same way
    without a generator (`_run`)."""
    while lanes:
        best, limit = _best_lane(lanes)
        yield best[1]
        # Stay in this lane while its scores stay below every other lane's head.
        below = limit - best[3]
        for key, stamp in best[2]:
            if key not in pinned and key not in protected:
                if stamp >= below:
                    best[0], best[1] = stamp + best[3], key
                    break
                yield key
        else:
            lanes.remove(best)


def _run(best: list, below: float, left: int, pinned: set[OffloadKey], protected: set[OffloadKey],
         chosen: list[OffloadKey], met: list[tuple[int, OffloadKey]]) -> tuple[int, bool]:
    """`evict`'s run in lane `best` (from `_heads`): take its evictable, unprotected keys while
    their stamps stay below `below` (the other lanes' best score less this lane's offset), at most
    `left`; pinned or protected keys passed are appended to `met`. Returns (left, whether the
    lane ran out). A lane stopped by a key at or above `below` holds it as its new head.

    Chunks of at most `left` entries whose keys are all taken (evictable, unprotected, below)
    are taken in C loops, and so is a chunk's part before its first stamp at or above `below`
    when all of it may go; the rest of a chunk is walked key by key, and what the walk did not
    reach is put back in front of the lane's iterator."""
    it = best[2]
    taken = best[5]
    while True:
        chunk = list(islice(it, left))
        if not chunk:
            return left, True
        keys = list(map(_first, chunk))
        stamps = list(map(_second, chunk))
        # Taken in C loops when all of it may go: the chunk, or its part before its first stamp at
        # or above `below` (then fewer than `left`, and the walk goes on from that stamp).
        start = len(chunk) if max(stamps) < below else list(map(below.__le__, stamps)).index(True)
        if start and pinned.isdisjoint(islice(keys, start)) and protected.isdisjoint(islice(keys, start)):
            chosen += islice(keys, start)
            taken += islice(keys, start)
            left -= start
            if not left:
                return 0, False
            if start == len(chunk):
                continue
        else:
            start = 0
        for i in range(start, len(chunk)):
            key, stamp = chunk[i]
            if key not in pinned and key not in protected:
                if stamp >= below:
                    best[0], best[1] = stamp + best[3], key
                    if i + 1 < len(chunk):
                        best[2] = chain(chunk[i + 1:], it)
                    return left, False
                chosen.append(key)
                taken.append(key)
                left -= 1
                if not left:
                    return 0, False  # (the lane is not walked again by this eviction)
            else:
                met.append((best[4], key))


def _probes(segs: list[OrderedDict[OffloadKey, float]]) -> list[list]:
    """`touch`'s probes: per segment s, [s's pop, the segment its touched keys move to (2 from the
    tails, else s + 1 up to the top), the probes of the other segments in the order to try them
    (those above s first, then those below, nearest first)]."""
    top = len(segs) - 1
    probes: list[list] = [[seg.pop, segs[2 if s == _TAIL else min(s + 1, top)]] for s, seg in enumerate(segs)]
    for s, probe in enumerate(probes):
        probe.append(tuple(probes[t] for t in (*range(s + 1, top + 1), *range(s - 1, -1, -1))))
    return probes


def _take_tails(lane: Iterable[tuple[OffloadKey, Any]], left: int, pinned: set[OffloadKey],
                protected: set[OffloadKey], chosen: list[OffloadKey], tails: list[OffloadKey],
                met: list[tuple[int, OffloadKey]]) -> int:
    """`evict`'s first step while tails are one-time: take the evictable, unprotected keys of the
    tail segment's `lane` in order, at most `left`, into `chosen` and `tails`; pinned or protected
    keys passed are appended to `met`. Returns how many are still to be taken."""
    for key, _ in lane:
        if key not in pinned and key not in protected:
            chosen.append(key)
            tails.append(key)
            left -= 1
            if not left:
                break
        else:
            met.append((_TAIL, key))
    return left


def _walk_lanes(lanes: list[list], left: int, pinned: set[OffloadKey], protected: set[OffloadKey],
                chosen: list[OffloadKey], met: list[tuple[int, OffloadKey]]) -> int:
    """`evict`'s merge of `lanes` (from `_heads`; emptied as they run out): the best head, then a
    run of its lane (`_run`), until `left` keys are in `chosen`. Returns how many could not be
    taken (0: all of them)."""
    while lanes:
        best, limit = _best_lane(lanes)
        chosen.append(best[1])
        best[5].append(best[1])
        left -= 1
        if not left:
            break
        left, exhausted = _run(best, limit - best[3], left, pinned, protected, chosen, met)
        if exhausted:
            lanes.remove(best)
            continue
        if not left:
            break
    return left


def _forget(used: list[list], segs: list[OrderedDict[OffloadKey, float]], ghosts: dict[OffloadKey, int],
            departures: list[int]) -> None:
    """Delete an eviction's victims (`lane[5]` of each lane in `used`, from segment `lane[4]`)
    from their segment, remember them as ghosts, and count the evicted tails and new blocks in
    `departures` (`TailEvidence.counts`)."""
    for lane in used:
        taken = lane[5]
        if not taken:
            continue
        index = lane[4]
        if len(taken) == 1:
            key = taken[0]
            del segs[index][key]
            ghosts[key] = index
        else:
            # (`del` by subscript: a map over the bound `__delitem__` goes through a method
            # wrapper per key, which costs more than this loop)
            seg = segs[index]
            for key in taken:
                del seg[key]
            ghosts.update(dict.fromkeys(taken, index))
        if index <= 1:
            departures[EVICTED_TAIL if index == _TAIL else EVICTED_NEW] += len(taken)
