"""Blocks pinned by `prepare_load` until `complete_load`: the manager's load path.

A load pins each block (`ref_cnt += 1`) in the tier it is read from: tier 0, or a lower tier the
engine loads directly. `pins` maps a key to the tiers it is pinned in, in order, so `complete_load`
releases the last pin first. The common case (distinct keys, all readable in tier 0, none pinned
before; promoted there or not) runs in C loops over the batch; anything else goes key by key, with the same
answers and side effects (`tests/test_manager_bulk.py` checks the two against each other). When
tier 0's policy has batch calls (`CachePolicy.batch_calls`) the common case is its `readable_run`,
`pin_loads` and `release_loads`, with no block object or view per key. A load that also reads a
tier the engine loads directly goes through both tiers' batch calls when both have them
(`prepare_split`, `complete_split`; tests/test_manager_bulk_tiers.py checks them).
"""

from __future__ import annotations

from collections import deque as _consume
from itertools import compress, filterfalse, repeat
from operator import add, attrgetter, not_
from typing import cast

from kvtier.control.tier import Tier
from kvtier.keys import OffloadKey
from kvtier.specs import CompositeLoadStoreSpec, LoadStoreSpec
from kvtier.types import BlockStatus

_ref_cnt = attrgetter("ref_cnt")
_FIRST_CHUNK = 16  # keys `top_run` checks in its first C pass; later passes double it
_TOP_ONLY = (0,)  # the pins of a block that prepare_load pinned once, in tier 0


class LoadPins:
    """The load path over a hierarchy's tiers and the pins it holds (see the module docstring)."""

    def __init__(self, tiers: list[Tier]):
        self.tiers = tiers
        self.top = tiers[0]
        self.alone = len(tiers) == 1  # (no lower tier to load from)
        # key -> tiers pinned by prepare_load, in order (tuples: `_TOP_ONLY` is shared by the fast path)
        self.pins: dict[OffloadKey, tuple[int, ...]] = {}

    def prepare(self, keys: list[OffloadKey]) -> LoadStoreSpec:
        """Pin `keys` (each answered HIT by `lookup`) and return where to load them from."""
        spec = self.prepare_batch(keys) if self.top.batch else self.prepare_top(keys)
        if spec is None and not self.alone:
            spec = self.prepare_split(keys)
        return spec if spec is not None else self.prepare_each(keys)

    def complete(self, keys: list[OffloadKey]) -> None:
        """Release the pins `prepare` took for `keys` (the last pin of a key pinned twice)."""
        if not (self.complete_batch(keys) if self.top.batch else self.complete_top(keys)):
            if self.alone or not self.complete_split(keys):
                self.complete_each(keys)

    def top_run(self, keys: list[OffloadKey]) -> int:
        """How many leading `keys` are readable in tier 0, in C loops over chunks that double in
        size (a request that misses early costs little more than one `get`)."""
        if self.top.batch:
            return self.top.policy.readable_run(keys)
        get = self.top.policy.get
        if not keys or getattr(get(keys[0]), "ref_cnt", -1) < 0:
            return 0  # most misses miss at once: no lists built
        n, size, total = 1, _FIRST_CHUNK, len(keys)
        while n < total:
            ref_cnts = list(map(getattr, map(get, keys[n:n + size]), repeat("ref_cnt"), repeat(-1)))
            if -1 in ref_cnts:
                return n + ref_cnts.index(-1)
            n += len(ref_cnts)
            size *= 2
        return n

    def prepare_top(self, keys: list[OffloadKey]) -> LoadStoreSpec | None:
        """`prepare_load` in C loops for the common case: distinct keys, every one readable in
        tier 0 (promoted there or not), none pinned by an earlier load; None (nothing changed)
        otherwise."""
        top, pins = self.top, self.pins
        found = list(map(top.policy.get, keys))
        if not keys or not all(found) or (pins and not pins.keys().isdisjoint(keys)):
            return None  # (a BlockStatus is truthy: all(found) means all resident)
        before = len(pins)
        pins.update(zip(keys, repeat(_TOP_ONLY)))
        if len(pins) - before != len(keys):  # a key given twice: pinned twice, key by key
            _consume(map(pins.pop, keys, repeat(None)), 0)
            return None
        blocks = cast("list[BlockStatus]", found)
        for done, block in enumerate(blocks):  # noqa: B007 - (where it stopped) none pinned before: 0 -> 1
            if block.ref_cnt:
                break
            block.ref_cnt = 1
        else:
            done = len(blocks)
        if done < len(blocks):  # pinned by others too, or not readable (being written): undone
            ref_cnts = list(map(_ref_cnt, blocks[done:]))
            if -1 in ref_cnts:
                for block in blocks[:done]:
                    block.ref_cnt = 0
                _consume(map(pins.pop, keys, repeat(None)), 0)
                return None
            _consume(map(setattr, blocks[done:], repeat("ref_cnt"), map(add, ref_cnts, repeat(1))), 0)
        self._credit(keys)
        top.policy.pin(keys)
        return top.backend.get_load_store_spec(keys, blocks)

    def prepare_batch(self, keys: list[OffloadKey]) -> LoadStoreSpec | None:
        """`prepare_top` through tier 0's batch calls (`CachePolicy.pin_loads`): the same
        cases, answers and side effects, no block object per key."""
        pins = self.pins
        if not keys or (pins and not pins.keys().isdisjoint(keys)):
            return None
        before = len(pins)
        pins.update(zip(keys, repeat(_TOP_ONLY)))
        ids = self.top.policy.pin_loads(keys) if len(pins) - before == len(keys) else None
        if ids is None:  # a key given twice (pinned twice, key by key), or one not readable
            _consume(map(pins.pop, keys, repeat(None)), 0)
            return None
        self._credit(keys)
        return self.top.backend.spec_for_ids(keys, ids)

    def _credit(self, keys: list[OffloadKey], source: int = 0) -> None:
        """Count the hits of a batch loaded from tier `source`."""
        promoted = self.top.promoted_from
        if promoted and not promoted.keys().isdisjoint(keys):
            # Promoted into tier 0 and loaded now: the tier that supplied each is credited.
            origins = list(map(promoted.pop, keys, repeat(source)))
            for origin in sorted(set(origins)):
                self.tiers[origin].stats.hits += origins.count(origin)
        else:
            self.tiers[source].stats.hits += len(keys)

    def prepare_split(self, keys: list[OffloadKey]) -> LoadStoreSpec | None:
        """`prepare_load` through the batch calls (`Tier.batch`) of tier 0 and of the first tier
        below that the engine loads directly: distinct keys not pinned before, each readable in
        tier 0 or, absent there, readable in that tier. The same answers and side effects as
        `prepare_each`; None (nothing changed) otherwise."""
        top, pins = self.top, self.pins
        direct = next((t for t in self.tiers[1:] if t.direct_load), None)
        if direct is None or not (top.batch and direct.batch) or not keys or len(set(keys)) != len(keys):
            return None
        if pins and not pins.keys().isdisjoint(keys):
            return None
        rest = top.policy.absent(keys)  # (in order) loaded from `direct`; the others from tier 0
        if not rest:
            return None
        below = set(rest).__contains__
        head = list(filterfalse(below, keys))
        if top.policy.readable_run(head) != len(head) or direct.policy.readable_run(rest) != len(rest):
            return None  # (checked before pinning: nothing to undo)
        head_ids = cast("list[int]", top.policy.pin_loads(head))
        rest_ids = cast("list[int]", direct.policy.pin_loads(rest))
        pins.update(zip(head, repeat(_TOP_ONLY)))
        pins.update(zip(rest, repeat((direct.index,))))
        self._credit(head)  # (the tier that supplied a promoted key is credited, as by prepare_each)
        self._credit(rest, direct.index)
        spec = direct.backend.spec_for_ids(rest, rest_ids)
        if not head:
            return spec
        places = list(map(below, keys))  # position i: whether keys[i] comes from `direct`
        return CompositeLoadStoreSpec([
            (top.backend.spec_for_ids(head, head_ids), list(compress(range(len(keys)), map(not_, places)))),
            (spec, list(compress(range(len(keys)), places)))])

    def complete_split(self, keys: list[OffloadKey]) -> bool:
        """`complete_load` through the batch calls of the tiers the keys were loaded from, when
        each key (given once) is pinned once, in a tier whose policy has them (`Tier.batch`);
        False, with the pins unchanged, otherwise."""
        pins, tiers = self.pins, self.tiers
        if not keys:
            return False
        popped = list(map(pins.pop, keys, repeat(None)))
        by_tier: dict[int, list[OffloadKey]] = {}
        for key, pinned in zip(keys, popped):
            if pinned is None or len(pinned) != 1 or not tiers[pinned[0]].batch:
                pins.update(compress(zip(keys, cast("list[tuple[int, ...]]", popped)), popped))  # put back
                return False
            by_tier.setdefault(pinned[0], []).append(key)
        for index, released in by_tier.items():
            tiers[index].policy.release_loads(released)
        return True

    def prepare_each(self, keys: list[OffloadKey]) -> LoadStoreSpec:
        """`prepare_load` key by key: blocks in lower tiers, keys loaded twice, promoted keys."""
        parts: dict[int, tuple[list[OffloadKey], list[BlockStatus], list[int]]] = {}
        for pos, key in enumerate(keys):
            for tier in self.tiers:
                block = tier.policy.get(key)
                if block is not None and block.ref_cnt >= 0 and (tier.index == 0 or tier.direct_load):
                    break
            else:
                raise KeyError(f"prepare_load: block {key.hex()} is not readable (lookup did not answer HIT)")
            block.ref_cnt += 1
            self.pins[key] = self.pins.get(key, ()) + (tier.index,)
            origin = self.top.promoted_from.pop(key, tier.index)
            self.tiers[origin].stats.hits += 1
            entry = parts.setdefault(tier.index, ([], [], []))
            entry[0].append(key)
            entry[1].append(block)
            entry[2].append(pos)
        for index, (pinned_keys, _, _) in parts.items():
            self.tiers[index].policy.pin(pinned_keys)
        specs = [(self.tiers[i].backend.get_load_store_spec(k, b), p) for i, (k, b, p) in sorted(parts.items())]
        if len(specs) == 1:
            return specs[0][0]
        if not specs:
            return self.top.backend.get_load_store_spec([], [])
        return CompositeLoadStoreSpec(specs)

    def _release_top_pins(self, keys: list[OffloadKey]) -> bool:
        """Forget the load pins of `keys` when each is pinned once, in tier 0 (the batch case of
        `complete_load`); False, with the pins unchanged, otherwise (pinned elsewhere or twice,
        not pinned, given twice, or no keys)."""
        pins = self.pins
        if not keys:
            return False
        popped = list(map(pins.pop, keys, repeat(None)))
        if popped.count(_TOP_ONLY) != len(keys):
            pins.update(compress(zip(keys, cast("list[tuple[int, ...]]", popped)), popped))  # put back: no change
            return False
        return True

    def complete_top(self, keys: list[OffloadKey]) -> bool:
        """`complete_load` in C loops for the common case: distinct keys, each pinned once by
        `prepare_load` in tier 0; False (nothing changed) otherwise."""
        if not self._release_top_pins(keys):
            return False
        top = self.top
        blocks = cast("list[BlockStatus]", list(map(top.policy.get, keys)))
        for done, block in enumerate(blocks):  # noqa: B007 - (where it stopped) each pinned by this load only: 1 -> 0
            if block.ref_cnt != 1:
                break
            block.ref_cnt = 0
        else:
            top.policy.unpin(keys)
            return True
        ref_cnts = list(map(add, map(_ref_cnt, blocks[done:]), repeat(-1)))  # (pinned by others too)
        _consume(map(setattr, blocks[done:], repeat("ref_cnt"), ref_cnts), 0)
        top.policy.unpin(keys[:done] + list(compress(keys[done:], map(not_, ref_cnts))))
        return True

    def complete_batch(self, keys: list[OffloadKey]) -> bool:
        """`complete_top` through tier 0's batch calls (`CachePolicy.release_loads`)."""
        if not self._release_top_pins(keys):
            return False
        self.top.policy.release_loads(keys)
        return True

    def complete_each(self, keys: list[OffloadKey]) -> None:
        """`complete_load` key by key (blocks pinned in lower tiers or more than once)."""
        released: dict[int, list[OffloadKey]] = {}  # tier index -> keys whose ref_cnt reached 0
        for key in keys:
            pinned = self.pins.get(key)
            if not pinned:
                raise KeyError(f"complete_load: block {key.hex()} was not prepared for loading")
            tier = self.tiers[pinned[-1]]
            if len(pinned) > 1:
                self.pins[key] = pinned[:-1]
            else:
                del self.pins[key]
            block = tier.policy.get(key)
            assert block is not None, "a block pinned by prepare_load stays resident"
            block.ref_cnt -= 1
            if not block.ref_cnt:
                released.setdefault(tier.index, []).append(key)
        for index, unpinned in released.items():
            self.tiers[index].policy.unpin(unpinned)
