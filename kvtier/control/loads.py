"""Blocks pinned by `prepare_load` until `complete_load`: the manager's load path.

A load pins each block (`ref_cnt += 1`) in the tier it is read from: tier 0, or a lower tier the
engine loads directly (`Tier.direct_load`). `pins` maps a key to the tiers it is pinned in, in
order, so `complete_load` releases the last pin first. One path for every case, through the
policies' batch calls over slot ids (`readable_run`, `absent`, `pin_loads`, `release_loads`):
the keys are grouped by the tier they are read from and each group is pinned or released in one
call (a key given twice is pinned twice). The common case (every key readable in tier 0) is one
`pin_loads` on tier 0. A load that failed in the engine is completed naming the blocks that
failed, which are condemned in the tier it read them from (`complete`); one flushed by a cache
reset is released by `drop`, which also drops the blocks it read from the tiers it read them from.

Hits (`TierStats.hits`: blocks loaded into the engine that a tier supplied) are counted when a
load completes, for the blocks it delivered: every one of its keys, or, when some failed, those
before the first failed one in the order given (the standalone `load` returns that prefix and
discards the rest; vLLM's adapter, which gets a load's keys as a set, lists the failed ones last,
so there every block loaded counts). A failed block is counted once, in its tier's `failures`
(`Tier.condemn`), never in `hits`; a load flushed by a reset counts none.
"""

from __future__ import annotations

from collections import Counter
from collections import deque as _consume
from collections.abc import Collection
from itertools import compress, repeat
from typing import cast

from kvtier.control.context import ControlContext
from kvtier.core.keys import OffloadKey
from kvtier.core.specs import CompositeLoadStoreSpec, LoadStoreSpec

_TOP_ONLY = (0,)  # the pins of a block that prepare_load pinned once, in tier 0


class LoadPins:
    """The load path over a hierarchy's tiers and the pins it holds (see the module docstring)."""

    def __init__(self, ctx: ControlContext):
        self.tiers = ctx.tiers
        self.top = ctx.top
        self.events = ctx.events
        # key -> tiers pinned by prepare_load, in order (tuples: `_TOP_ONLY` is shared by the common case)
        self.pins: dict[OffloadKey, tuple[int, ...]] = {}

    def top_run(self, keys: list[OffloadKey]) -> int:
        """How many leading `keys` are readable in tier 0 (and not condemned: `Tier.condemn`)."""
        n = self.top.table.readable_run(keys)
        condemned = self.top.condemned
        if condemned and not condemned.isdisjoint(keys[:n]):
            n = next(i for i, key in enumerate(keys) if key in condemned)
        return n

    def prepare(self, keys: list[OffloadKey]) -> LoadStoreSpec:
        """Pin `keys` (each answered HIT by `lookup`) and return where to load them from: for each
        key, the first of tier 0 and the tiers loaded directly that holds it readable. KeyError
        (nothing changed) for a key that none holds readable."""
        top = self.top
        ids = top.table.pin_loads(keys)  # (None, nothing changed: some key is not readable there)
        if ids is not None:
            self._record(keys, 0)
            return top.backend.spec_for_ids(keys, ids)
        parts: list[tuple[LoadStoreSpec, list[int]]] = []
        for index, positions in self._sources(keys).items():
            group = [keys[p] for p in positions]
            tier = self.tiers[index]
            ids = cast("list[int]", tier.table.pin_loads(group))  # (readable: checked by `_sources`)
            self._record(group, index)
            parts.append((tier.backend.spec_for_ids(group, ids), positions))
        return parts[0][0] if len(parts) == 1 else CompositeLoadStoreSpec(parts)

    def complete(self, keys: list[OffloadKey], failed: Collection[OffloadKey] = ()) -> None:
        """Release the pins `prepare` took for `keys` (the last pin of a key pinned twice);
        KeyError (nothing changed) for a key that holds no pin. `failed`: those of `keys` the
        engine could not load (their read failed, e.g. verification): each is condemned in the
        tier this load read it from (`Tier.condemn`: counted once there, never served again,
        removed once unpinned); a copy in another tier stays. The delivered keys (all of `keys`,
        else those before the first failed one) count as hits of the tiers that supplied them
        (`_credit`); the failed ones and those after them count none."""
        if failed:
            delivered = self._release_failed(keys, set(failed))
        elif self._release_top_pins(keys):  # (the common case: each pinned once, in tier 0)
            top = self.top
            self.events.record(top, top.release_loads(keys), removed=True)
            self._credit(keys, 0)
            return
        else:
            delivered = self._release_each(keys)
        for index, released in delivered.items():
            self._credit(released, index)

    def _release_failed(self, keys: list[OffloadKey], bad: set[OffloadKey]) -> dict[int, list[OffloadKey]]:
        """`complete` of a load whose keys `bad` failed: condemn them, release every pin, and
        return the delivered keys (those before the first bad one) by the tier they were read from."""
        first = next((i for i, key in enumerate(keys) if key in bad), len(keys))
        self._condemn(keys, bad)
        delivered = Counter(keys[:first])  # (a key given twice: as many times as it was delivered)
        by_tier: dict[int, list[OffloadKey]] = {}
        for index, released in self._release(keys).items():
            for key in released:
                if delivered[key] > 0:
                    delivered[key] -= 1
                    by_tier.setdefault(index, []).append(key)
        return by_tier

    def _condemn(self, keys: list[OffloadKey], failed: set[OffloadKey]) -> None:
        """Condemn the `failed` ones of `keys` in the tier of their last pin (the load's)."""
        by_tier: dict[int, list[OffloadKey]] = {}
        for key in dict.fromkeys(keys):
            pinned = self.pins.get(key)
            if key in failed and pinned:
                by_tier.setdefault(pinned[-1], []).append(key)
        for index, bad in by_tier.items():
            self.tiers[index].condemn(bad)

    def drop(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """A load that a cache reset flushed (the engine never completes it): release one pin of
        each of `keys` (as `complete`; a key that holds no pin is ignored), then drop each block
        left unpinned from the tier the load read it from (the reset evicts it now; a copy in
        another tier stays). Returns the keys dropped; their removal events are recorded. No hit
        is counted: the engine discards what the load copied."""
        pins = self.pins
        counted: dict[OffloadKey, int] = {}
        held = []
        for key in keys:
            n = counted.get(key, 0)
            if n < len(pins.get(key, ())):
                held.append(key)
                counted[key] = n + 1
        dropped: list[OffloadKey] = []
        for index, released in self._release(held).items():
            tier = self.tiers[index]
            gone = tier.remove(released)
            self.events.record(tier, gone, removed=True)
            dropped += gone
        return dropped

    def _release(self, keys: list[OffloadKey]) -> dict[int, list[OffloadKey]]:
        """`complete`: the keys released, by the index of the tier each pin was in (condemned
        blocks left unpinned are removed: `Tier.release_loads`, their events recorded)."""
        if self._release_top_pins(keys):
            self.events.record(self.top, self.top.release_loads(keys), removed=True)
            return {0: keys}
        return self._release_each(keys)

    def _release_each(self, keys: list[OffloadKey]) -> dict[int, list[OffloadKey]]:
        """`_release` past its common case: key by key (pinned elsewhere or twice, or given twice)."""
        pins = self.pins
        left: dict[OffloadKey, tuple[int, ...]] = {}  # key -> its pins once these are released
        by_tier: dict[int, list[OffloadKey]] = {}
        for key in keys:
            pinned = left[key] if key in left else pins.get(key)
            if not pinned:
                raise KeyError(f"complete_load: block {key.hex()} was not prepared for loading")
            left[key] = pinned[:-1]
            by_tier.setdefault(pinned[-1], []).append(key)
        for key, rest in left.items():
            if rest:
                pins[key] = rest
            else:
                del pins[key]
        for index, released in by_tier.items():
            tier = self.tiers[index]
            self.events.record(tier, tier.release_loads(released), removed=True)
        return by_tier

    def _sources(self, keys: list[OffloadKey]) -> dict[int, list[int]]:
        """Tier index -> the positions of the `keys` loaded from it, lowest index first (see
        `prepare`); KeyError for a key that no such tier holds readable."""
        left = list(range(len(keys)))  # positions not placed yet
        placed: dict[int, list[int]] = {}
        for tier in self.tiers:
            if tier.index and not tier.direct_load:
                continue
            absent = set(tier.table.absent([keys[p] for p in left]))
            held = [p for p in left if keys[p] not in absent]
            if tier.table.readable_run([keys[p] for p in held]) != len(held):  # (some being written)
                held = [p for p in held if tier.readable(keys[p]) is not None]
            if held:
                placed[tier.index] = held
                taken = set(held)
                left = [p for p in left if p not in taken]
            if not left:
                return placed
        raise KeyError(f"prepare_load: block {keys[left[0]].hex()} is not readable (lookup did not answer HIT)")

    def _record(self, keys: list[OffloadKey], index: int) -> None:
        """Add a pin in tier `index` to each of `keys` (twice for a key given twice)."""
        pins = self.pins
        if not pins or pins.keys().isdisjoint(keys):
            before = len(pins)
            pins.update(zip(keys, repeat(_TOP_ONLY if index == 0 else (index,))))
            if len(pins) - before == len(keys):
                return
            _consume(map(pins.pop, keys, repeat(None)), 0)  # a key given twice: counted below
        get = pins.get
        for key in keys:
            pins[key] = get(key, ()) + (index,)

    def _credit(self, keys: list[OffloadKey], source: int) -> None:
        """Count the hits of a batch delivered from tier `source` (a completed load's): a block
        promoted into tier 0 and not loaded since is credited to the tier that supplied it."""
        promoted = self.top.promoted_from
        if promoted and not promoted.keys().isdisjoint(keys):
            # Promoted into tier 0 and loaded now: the tier that supplied each is credited.
            origins = list(map(promoted.pop, keys, repeat(source)))
            for origin in sorted(set(origins)):
                self.tiers[origin].stats.hits += origins.count(origin)
        else:
            self.tiers[source].stats.hits += len(keys)

    def _release_top_pins(self, keys: list[OffloadKey]) -> bool:
        """Forget the load pins of `keys` when each is pinned once, in tier 0 (the common case of
        `complete`); False, with the pins unchanged, otherwise (pinned elsewhere or twice, not
        pinned, given twice, or no keys)."""
        pins = self.pins
        if not keys:
            return False
        popped = list(map(pins.pop, keys, repeat(None)))
        if popped.count(_TOP_ONLY) != len(keys):
            pins.update(compress(zip(keys, cast("list[tuple[int, ...]]", popped)), popped))  # put back: no change
            return False
        return True
