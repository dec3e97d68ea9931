"""Least-recently-used replacement in pure Python: `PureLRUCachePolicy`, the twin of the registered
`lru` (`kvtier.policies.lru_compiled.LRUCachePolicy`, a compiled index making the same decisions)
and its fallback where the extension is not built.

With the block table's evictable notices (`CachePolicy.evictable`, sent by every tier) pinned blocks
leave the eviction order: a block found pinned at the head of the order is set *aside* (it keeps
a sequence number, its place in the order) instead of being scanned again on every eviction;
when it is unpinned it becomes a *freed* aside block. Every aside block was set aside from the
head, so it is older than every block still in the order, and the aside blocks are ordered by
their sequence numbers: the eviction order is freed aside blocks (oldest first) and then the
order's unpinned blocks, exactly the order of plain LRU. A touched aside block rejoins the order
at its newest end, as in plain LRU.

Representation: `blocks` (an OrderedDict) holds every resident block; an aside key is moved to
its newest end (out of the way of the head) but is not part of the order while it is in
`aside` (key -> sequence number). `_freed` is a heap of (sequence number, key) of unpinned aside
keys (entries of keys no longer aside, or pinned again, are skipped when popped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections import deque as _consume
from collections.abc import Collection, Iterable, Sequence
from heapq import heappop, heappush
from itertools import islice, repeat
from operator import attrgetter, itemgetter

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus
from kvtier.policies.base import CachePolicy, evictable, first_keys

_first = itemgetter(0)
_second = itemgetter(1)
_ref_cnt = attrgetter("ref_cnt")


class PureLRUCachePolicy(CachePolicy):
    """Evicts the least recently inserted or touched unpinned block first."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.get = self.blocks.get  # type: ignore[method-assign,assignment]  # hot path (every lookup): one C call
        self.aside: dict[OffloadKey, int] = {}  # key -> sequence number (only with evictable notices)
        self._freed: list[tuple[int, OffloadKey]] = []
        self._seq = 0

    def get(self, key: OffloadKey) -> BlockStatus | None:  # replaced per instance by blocks.get
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    tail: OffloadKey | None = None) -> None:
        self.blocks.update(zip(keys, blocks))

    def remove(self, key: OffloadKey) -> None:
        self.blocks.pop(key, None)
        if self._pinned is not None:
            self.aside.pop(key, None)
            self._pinned.discard(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        blocks = self.blocks
        move = blocks.move_to_end
        keys = keys if isinstance(keys, list) else list(keys)
        if self.aside:
            _consume(map(self.aside.pop, keys, repeat(None)), 0)  # touched: back in the order
        try:
            _consume(map(move, reversed(keys)), 0)
        except KeyError:  # some keys are not resident: again without them (the same final order)
            _consume(map(move, filter(blocks.__contains__, reversed(keys))), 0)

    def evictable(self, keys: Iterable[OffloadKey], flag: bool) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        pinned, aside = self._pinned, self.aside
        if pinned is None or not flag or not aside or aside.keys().isdisjoint(keys):
            super().evictable(keys, flag)
            return
        freed = self._freed
        for key in keys:  # freed aside blocks go first in the next evictions
            pinned.discard(key)
            seq = aside.get(key)
            if seq is not None:
                heappush(freed, (seq, key))

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if n <= 0:
            return []
        if self._pinned is not None:
            return self._evict_tracked(n, protected)
        chosen = list(islice(self.blocks.items(), n))
        keys = list(map(_first, chosen))
        if len(chosen) < n or not protected.isdisjoint(keys) or any(map(_ref_cnt, map(_second, chosen))):
            # Some of the n oldest are pinned or protected (or too few blocks): filter them.
            chosen = list(islice(evictable(self.blocks.items(), protected), n))
            if len(chosen) < n:
                return None
            keys = [key for key, _ in chosen]
        _consume(map(self.blocks.__delitem__, keys), 0)
        return chosen

    def _evict_tracked(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """`evict` with evictable accounting: refuse at once when fewer than n blocks are
        evictable; take freed aside blocks first, then the order's head, setting aside the
        pinned (and protected) blocks met there so that no later eviction scans them again."""
        blocks, aside, pinned = self.blocks, self.aside, self._pinned
        assert pinned is not None
        if len(blocks) - len(pinned) < n + len(protected) and self._refuses(n, protected):
            return None
        if not self._freed and len(blocks) >= n:
            # The common case: no freed aside block goes first, so the victims are the order's
            # head. Taken off in one C pass; put back as they were if one of them may not go.
            head = list(map(blocks.popitem, repeat(False, n)))
            keys = list(map(_first, head))
            if (protected.isdisjoint(keys) and pinned.isdisjoint(keys) and (not aside or aside.keys().isdisjoint(keys))
                    and not any(map(_ref_cnt, map(_second, head)))):
                return head
            blocks.update(head)
            _consume(map(blocks.move_to_end, reversed(keys), repeat(False)), 0)
        chosen: list[tuple[OffloadKey, BlockStatus]] = []
        taken, kept = self._take_freed(n, protected, chosen)
        freed = self._freed
        need = n - len(chosen)
        if need:
            head = list(islice(blocks.items(), need))
            keys = list(map(_first, head))
            if (len(head) == need and protected.isdisjoint(keys) and pinned.isdisjoint(keys)
                    and aside.keys().isdisjoint(keys) and not any(map(_ref_cnt, map(_second, head)))):
                chosen += head  # the common case: the head is evictable
            elif not self._scan_head(need, protected, chosen):
                kept += taken
                chosen = []
        for entry in kept:
            heappush(freed, entry)
        if not chosen:
            return None
        victims = list(map(_first, chosen))
        _consume(map(blocks.__delitem__, victims), 0)
        if aside:
            _consume(map(aside.pop, victims, repeat(None)), 0)
        return chosen

    def _take_freed(self, n: int, protected: set[OffloadKey],
                    chosen: list[tuple[OffloadKey, BlockStatus]]) -> tuple[list, list]:
        """Pop freed aside blocks, oldest first, into `chosen` until it holds `n`; stale heap
        entries are dropped. Returns (the heap entries chosen, those passed over: protected or
        pinned); the caller pushes back the passed-over ones, and the chosen ones on a refusal."""
        blocks, aside, pinned, freed = self.blocks, self.aside, self._pinned, self._freed
        assert pinned is not None
        taken: list[tuple[int, OffloadKey]] = []
        kept: list[tuple[int, OffloadKey]] = []
        last = None
        while freed and len(chosen) < n:
            entry = heappop(freed)
            seq, key = entry
            if aside.get(key) != seq or key in pinned or entry == last:
                continue  # stale (touched, removed, evicted, pinned again) or a duplicate (popped in a row)
            last = entry
            if key in protected or blocks[key].ref_cnt != 0:
                kept.append(entry)
            else:
                taken.append(entry)
                chosen.append((key, blocks[key]))
        return taken, kept

    def _scan_head(self, need: int, protected: set[OffloadKey],
                   chosen: list[tuple[OffloadKey, BlockStatus]]) -> bool:
        """Append the `need` oldest evictable, unprotected blocks of the order to `chosen`,
        setting aside the pinned and protected ones met before them (in order, so the order is
        kept); False when there are not that many (nothing chosen then, everything met aside)."""
        blocks, aside, pinned, freed = self.blocks, self.aside, self._pinned, self._freed
        assert pinned is not None
        seq = self._seq
        met: list[OffloadKey] = []  # keys to move out of the head
        taken: list[tuple[OffloadKey, BlockStatus]] = []
        for key, block in blocks.items():
            if key in aside:
                met.append(key)  # aside since an earlier scan: keep it away from the head
            elif key in pinned or block.ref_cnt != 0:
                aside[key] = seq
                seq += 1
                met.append(key)
            elif key in protected:
                aside[key] = seq
                heappush(freed, (seq, key))
                seq += 1
                met.append(key)
            else:
                taken.append((key, block))
                if len(taken) == need:
                    break
        else:
            # Too few (the accounting was told less than the truth): set the found ones aside
            # too, after the others, so that the order is kept, and refuse.
            for key, _ in taken:
                aside[key] = seq
                heappush(freed, (seq, key))
                seq += 1
                met.append(key)
            taken = []
        self._seq = seq
        _consume(map(blocks.move_to_end, met), 0)
        chosen += taken
        return bool(taken)

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        if self._pinned is None or n <= 0:
            return first_keys(evictable(self.blocks.items(), ()), n, skip)
        if skip:  # (LRU's order does not depend on what is skipped)
            return [k for k in self._head_keys(n + len(skip)) if k not in skip][:n]
        return self._head_keys(n)

    def _head_keys(self, n: int) -> list[OffloadKey]:
        """`victims` with evictable notices: the freed aside keys, then the order's
        evictable keys, in chunks checked with C loops (a chunk with a pinned, aside or
        unreadable block is filtered key by key)."""
        blocks, aside, pinned = self.blocks, self.aside, self._pinned
        assert pinned is not None
        out = [key for _, key in sorted((seq, key) for key, seq in aside.items() if key not in pinned)
               if blocks[key].ref_cnt == 0] if aside else []
        del out[n:]
        items = iter(blocks.items())
        while len(out) < n:
            chunk = list(islice(items, n - len(out)))
            if not chunk:
                break
            keys = list(map(_first, chunk))
            if (pinned.isdisjoint(keys) and aside.keys().isdisjoint(keys)
                    and not any(map(_ref_cnt, map(_second, chunk)))):
                out += keys
            else:
                out += [k for k, b in chunk if b.ref_cnt == 0 and k not in aside and k not in pinned]
        return out

    def clear(self) -> None:
        self.blocks.clear()
        self.aside.clear()
        self._freed.clear()
        if self._pinned is not None:
            self._pinned.clear()

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self) -> Iterable[OffloadKey]:
        return self.blocks.keys()
