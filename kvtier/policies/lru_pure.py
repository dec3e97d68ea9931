"""Least-recently-used replacement in pure Python: `PureLRUCachePolicy`, the twin of the registered
`lru` (`kvtier.policies.lru_compiled.LRUCachePolicy`, a compiled index making the same decisions)
and its fallback where the extension is not built. It is `PureLRUOrder` (keys only) composed with
the pure block table (`kvtier.policies.pure.PurePolicy`), which holds the blocks and tells the
order which keys are pinned (`evictable`).

Pinned keys leave the eviction order: a key found pinned at the head of the order is set *aside*
(it keeps a sequence number, its place in the order) instead of being scanned again on every
eviction; when it is unpinned it becomes a *freed* aside key. Every aside key was set aside from
the head, so it is older than every key still in the order, and the aside keys are ordered by
their sequence numbers: the eviction order is freed aside keys (oldest first) and then the
order's unpinned keys, exactly the order of plain LRU. A touched aside key rejoins the order at
its newest end, as in plain LRU.

Representation: `queue` (an OrderedDict) holds every resident key; an aside key is moved to its
newest end (out of the way of the head) but is not part of the order while it is in `aside`
(key -> sequence number). `_freed` is a heap of (sequence number, key) of unpinned aside keys
(entries of keys no longer aside, or pinned again, are skipped when popped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Collection, Sequence
from heapq import heappop, heappush
from itertools import islice, repeat
from operator import itemgetter

from kvtier.core.keys import OffloadKey
from kvtier.policies.pure import KeyOrder, PurePolicy

_first = itemgetter(0)


class PureLRUOrder(KeyOrder):
    """Least recently inserted or touched unpinned key first (`kvtier.index.pure.Order`)."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: OrderedDict[OffloadKey, None] = OrderedDict()
        self.aside: dict[OffloadKey, int] = {}  # key -> sequence number
        self._freed: list[tuple[int, OffloadKey]] = []
        self._seq = 0

    def insert(self, keys: Sequence[OffloadKey], tail: OffloadKey | None) -> None:
        self.queue.update(dict.fromkeys(keys))

    def remove(self, key: OffloadKey) -> None:
        self.queue.pop(key, None)
        self.aside.pop(key, None)
        self.pinned.discard(key)

    def touch(self, keys: list[OffloadKey]) -> None:
        queue = self.queue
        move = queue.move_to_end
        if self.aside:
            _consume(map(self.aside.pop, keys, repeat(None)), 0)  # touched: back in the order
        try:
            _consume(map(move, reversed(keys)), 0)
        except KeyError:  # some keys are not resident: again without them (the same final order)
            _consume(map(move, filter(queue.__contains__, reversed(keys))), 0)

    def evictable(self, keys: list[OffloadKey], flag: bool) -> None:
        pinned, aside = self.pinned, self.aside
        if not flag or not aside or aside.keys().isdisjoint(keys):
            super().evictable(keys, flag)
            return
        freed = self._freed
        for key in keys:  # freed aside keys go first in the next evictions
            pinned.discard(key)
            seq = aside.get(key)
            if seq is not None:
                heappush(freed, (seq, key))

    def evict(self, n: int, skip: set[OffloadKey]) -> list[OffloadKey] | None:
        """Freed aside keys first, then the order's head, setting aside the pinned (and skipped)
        keys met there so that no later eviction scans them again."""
        queue, aside, pinned = self.queue, self.aside, self.pinned
        if not self._freed and len(queue) >= n:
            # The common case: no freed aside key goes first, so the victims are the order's
            # head. Taken off in one C pass; put back as they were if one of them may not go.
            head = list(map(queue.popitem, repeat(False, n)))
            keys = list(map(_first, head))
            if skip.isdisjoint(keys) and pinned.isdisjoint(keys) and (not aside or aside.keys().isdisjoint(keys)):
                return keys
            queue.update(head)
            _consume(map(queue.move_to_end, reversed(keys), repeat(False)), 0)
        chosen: list[OffloadKey] = []
        taken, kept = self._take_freed(n, skip, chosen)
        freed = self._freed
        need = n - len(chosen)
        if need:
            keys = list(islice(queue, need))
            if (len(keys) == need and skip.isdisjoint(keys) and pinned.isdisjoint(keys)
                    and aside.keys().isdisjoint(keys)):
                chosen += keys  # the common case: the head is evictable
            elif not self._scan_head(need, skip, chosen):
                kept += taken
                chosen = []
        for entry in kept:
            heappush(freed, entry)
        if not chosen:
            return None
        _consume(map(queue.__delitem__, chosen), 0)
        if aside:
            _consume(map(aside.pop, chosen, repeat(None)), 0)
        return chosen

    def _take_freed(self, n: int, skip: set[OffloadKey], chosen: list[OffloadKey]) -> tuple[list, list]:
        """Pop freed aside keys, oldest first, into `chosen` until it holds `n`; stale heap
        entries are dropped. Returns (the heap entries chosen, those passed over: skipped); the
        caller pushes back the passed-over ones, and the chosen ones on a refusal."""
        aside, pinned, freed = self.aside, self.pinned, self._freed
        taken: list[tuple[int, OffloadKey]] = []
        kept: list[tuple[int, OffloadKey]] = []
        last = None
        while freed and len(chosen) < n:
            entry = heappop(freed)
            seq, key = entry
            if aside.get(key) != seq or key in pinned or entry == last:
                continue  # stale (touched, removed, evicted, pinned again) or a duplicate (popped in a row)
            last = entry
            if key in skip:
                kept.append(entry)
            else:
                taken.append(entry)
                chosen.append(key)
        return taken, kept

    def _scan_head(self, need: int, skip: set[OffloadKey], chosen: list[OffloadKey]) -> bool:
        """Append the `need` oldest evictable keys of the order not in `skip` to `chosen`,
        setting aside the pinned and skipped ones met before them (in order, so the order is
        kept); False when there are not that many (nothing chosen then, everything met aside)."""
        queue, aside, pinned, freed = self.queue, self.aside, self.pinned, self._freed
        seq = self._seq
        met: list[OffloadKey] = []  # keys to move out of the head
        taken: list[OffloadKey] = []
        for key in queue:
            if key in aside:
                met.append(key)  # aside since an earlier scan: keep it away from the head
            elif key in pinned:
                aside[key] = seq
                seq += 1
                met.append(key)
            elif key in skip:
                aside[key] = seq
                heappush(freed, (seq, key))
                seq += 1
                met.append(key)
            else:
                taken.append(key)
                if len(taken) == need:
                    break
        else:
            # Too few (the table was told less than the truth): set the found ones aside too,
            # after the others, so that the order is kept, and refuse.
            for key in taken:
                aside[key] = seq
                heappush(freed, (seq, key))
                seq += 1
                met.append(key)
            taken = []
        self._seq = seq
        _consume(map(queue.move_to_end, met), 0)
        chosen += taken
        return bool(taken)

    def victims(self, n: int, skip: Collection[OffloadKey]) -> list[OffloadKey]:
        if skip:  # (LRU's order does not depend on what is skipped)
            return [k for k in self._head_keys(n + len(skip)) if k not in skip][:n]
        return self._head_keys(n)

    def _head_keys(self, n: int) -> list[OffloadKey]:
        """`victims`: the freed aside keys, then the order's evictable keys, in chunks checked
        with C loops (a chunk with a pinned or aside key is filtered key by key)."""
        queue, aside, pinned = self.queue, self.aside, self.pinned
        out = [key for _, key in sorted((seq, key) for key, seq in aside.items() if key not in pinned)] if aside else []
        del out[n:]
        keys = iter(queue)
        while len(out) < n:
            chunk = list(islice(keys, n - len(out)))
            if not chunk:
                break
            if pinned.isdisjoint(chunk) and aside.keys().isdisjoint(chunk):
                out += chunk
            else:
                out += [k for k in chunk if k not in aside and k not in pinned]
        return out

    def clear(self) -> None:
        self.queue.clear()
        self.aside.clear()
        self._freed.clear()
        self.pinned.clear()


class PureLRUCachePolicy(PurePolicy):
    """Evicts the least recently inserted or touched unpinned block first."""

    def make_order(self) -> PureLRUOrder:
        return PureLRUOrder()

    @property
    def aside(self) -> dict[OffloadKey, int]:
        """The order's keys set aside (key -> sequence number): inspection."""
        return self.order.aside
