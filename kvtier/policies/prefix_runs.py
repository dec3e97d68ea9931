"""The eviction walk of `prefix-freq` (kvtier/policies/prefix_pure.py): the lanes' heads, the
tails taken first while they are one-time, the k-way merge of the segment lanes by score, a run
of victims taken from one lane while it stays below the other heads, and the bookkeeping of the
blocks a run evicted; also `touch`'s probes. Module functions over the policy's structures, kept
apart so that the policy module stays one readable size."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import chain, islice
from operator import attrgetter, itemgetter
from typing import Any

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus
from kvtier.policies.prefix_tails import EVICTED_NEW, EVICTED_TAIL

_first = itemgetter(0)
_second = itemgetter(1)
_ref_cnt = attrgetter("ref_cnt")
_TAIL = 0  # segment index of request tails; segment 1 + c holds the blocks with c hits
_INF = float("inf")


def _heads(policy: Any, protected: set[OffloadKey], first: int,
           met: list[tuple[int, OffloadKey]] | None = None) -> list[list]:
    """The lanes of `policy` (a `PurePrefixFreqCachePolicy`): per non-empty segment from `first` on,
    [score of its first evictable block, key, block, iterator, offset, segment index, keys taken so
    far]. Offset = credit * unit (tails: 0). The keys passed over (pinned, protected) are appended
    to `met` when it is given."""
    blocks, unit, credits = policy.blocks, policy.unit, policy.credits
    lanes: list[list] = []
    segs = policy.segs
    freed = policy._aside.freed
    lane_of, pinned = policy._aside.lane, policy._pinned
    for index in range(first, len(segs)):
        if freed[index]:  # (a segment may hold only aside keys)
            it = lane_of(index, pinned)
        elif segs[index]:
            it = iter(segs[index].items())  # (`lane_of` when no key is aside)
        else:
            continue
        for key, stamp in it:
            block = blocks[key]
            if block.ref_cnt == 0 and key not in protected:
                offset = credits[index - 1] * unit if index else 0.0
                lanes.append([stamp + offset, key, block, it, offset, index, []])
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


def _merged(lanes: list[list], blocks: dict[OffloadKey, BlockStatus],
            protected: set[OffloadKey]) -> Iterator[tuple[OffloadKey, BlockStatus]]:
    """The evictable blocks of `lanes` (from `_heads`) by increasing score, ties to the lower
    segment: a k-way merge that compares only the lanes' heads. `evict` walks the same way
    without a generator (`_run`)."""
    while lanes:
        best, limit = _best_lane(lanes)
        yield best[1], best[2]
        # Stay in this lane while its scores stay below every other lane's head.
        below = limit - best[4]
        for key, stamp in best[3]:
            block = blocks[key]
            if block.ref_cnt == 0 and key not in protected:
                if stamp >= below:
                    best[0], best[1], best[2] = stamp + best[4], key, block
                    break
                yield key, block
        else:
            lanes.remove(best)


def _run(best: list, below: float, left: int, blocks: dict[OffloadKey, BlockStatus], protected: set[OffloadKey],
         chosen: list[tuple[OffloadKey, BlockStatus]], met: list[tuple[int, OffloadKey]] | None) -> tuple[int, bool]:
    """`evict`'s run in lane `best` (from `_heads`): take its evictable, unprotected blocks while
    their stamps stay below `below` (the other lanes' best score less this lane's offset), at most
    `left`; pinned or protected keys passed are appended to `met`. Returns (left, whether the
    lane ran out). A lane stopped by a block at or above `below` holds it as its new head.

    Chunks of at most `left` entries whose blocks are all taken (evictable, unprotected, below)
    are taken in C loops, and so is a chunk's part before its first stamp at or above `below`
    when all of it may go; the rest of a chunk is walked key by key, and what the walk did not
    reach is put back in front of the lane's iterator."""
    it = best[3]
    taken = best[6]
    get = blocks.__getitem__
    while True:
        chunk = list(islice(it, left))
        if not chunk:
            return left, True
        keys = list(map(_first, chunk))
        found = list(map(get, keys))
        stamps = list(map(_second, chunk))
        # Taken in C loops when all of it may go: the chunk, or its part before its first stamp at
        # or above `below` (then fewer than `left`, and the walk goes on from that stamp).
        start = len(chunk) if max(stamps) < below else list(map(below.__le__, stamps)).index(True)
        if start and not any(map(_ref_cnt, islice(found, start))) and protected.isdisjoint(islice(keys, start)):
            chosen += zip(islice(keys, start), found)
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
            block = found[i]
            if block.ref_cnt == 0 and key not in protected:
                if stamp >= below:
                    best[0], best[1], best[2] = stamp + best[4], key, block
                    if i + 1 < len(chunk):
                        best[3] = chain(chunk[i + 1:], it)
                    return left, False
                chosen.append((key, block))
                taken.append(key)
                left -= 1
                if not left:
                    return 0, False  # (the lane is not walked again by this eviction)
            elif met is not None:
                met.append((best[5], key))


def _probes(segs: list[OrderedDict[OffloadKey, float]]) -> list[list]:
    """`touch`'s probes: per segment s, [s's pop, the segment its touched keys move to (2 from the
    tails, else s + 1 up to the top), the probes of the other segments in the order to try them
    (those above s first, then those below, nearest first)]."""
    top = len(segs) - 1
    probes: list[list] = [[seg.pop, segs[2 if s == _TAIL else min(s + 1, top)]] for s, seg in enumerate(segs)]
    for s, probe in enumerate(probes):
        probe.append(tuple(probes[t] for t in (*range(s + 1, top + 1), *range(s - 1, -1, -1))))
    return probes


def _take_tails(lane: Iterable[tuple[OffloadKey, Any]], left: int, blocks: dict[OffloadKey, BlockStatus],
                protected: set[OffloadKey], chosen: list[tuple[OffloadKey, BlockStatus]], tails: list[OffloadKey],
                met: list[tuple[int, OffloadKey]] | None) -> int:
    """`evict`'s first step while tails are one-time: take the evictable, unprotected keys of the
    tail segment's `lane` in order, at most `left`, into `chosen` and `tails`; pinned or protected
    keys passed are appended to `met`. Returns how many are still to be taken."""
    for key, _ in lane:
        block = blocks[key]
        if block.ref_cnt == 0 and key not in protected:
            chosen.append((key, block))
            tails.append(key)
            left -= 1
            if not left:
                break
        elif met is not None:
            met.append((_TAIL, key))
    return left


def _walk_lanes(lanes: list[list], left: int, blocks: dict[OffloadKey, BlockStatus], protected: set[OffloadKey],
                chosen: list[tuple[OffloadKey, BlockStatus]], met: list[tuple[int, OffloadKey]] | None) -> int:
    """`evict`'s merge of `lanes` (from `_heads`; emptied as they run out): the best head, then a
    run of its lane (`_run`), until `left` blocks are in `chosen`. Returns how many could not be
    taken (0: all of them)."""
    while lanes:
        best, limit = _best_lane(lanes)
        chosen.append((best[1], best[2]))
        best[6].append(best[1])
        left -= 1
        if not left:
            break
        left, exhausted = _run(best, limit - best[4], left, blocks, protected, chosen, met)
        if exhausted:
            lanes.remove(best)
            continue
        if not left:
            break
    return left


def _forget(used: list[list], segs: list[OrderedDict[OffloadKey, float]], blocks: dict[OffloadKey, BlockStatus],
            ghosts: dict[OffloadKey, int], departures: list[int]) -> None:
    """Delete an eviction's victims (`lane[6]` of each lane in `used`, from segment `lane[5]`)
    from their segment and the block map, remember them as ghosts, and count the evicted tails
    and new blocks in `departures` (`TailEvidence.counts`)."""
    for lane in used:
        taken = lane[6]
        if not taken:
            continue
        index = lane[5]
        if len(taken) == 1:
            key = taken[0]
            del segs[index][key]
            del blocks[key]
            ghosts[key] = index
        else:
            # (`del` by subscript: a map over the bound `__delitem__` goes through a method
            # wrapper per key, which costs more than this loop)
            seg = segs[index]
            for key in taken:
                del seg[key]
                del blocks[key]
            ghosts.update(dict.fromkeys(taken, index))
        if index <= 1:
            departures[EVICTED_TAIL if index == _TAIL else EVICTED_NEW] += len(taken)
