"""`CachePolicy`: decides which blocks leave a tier. Pure Python; knows nothing of bytes or slots."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence
from itertools import filterfalse, islice
from operator import itemgetter
from typing import Any

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus

_first = itemgetter(0)


class CachePolicy(ABC):
    """Block organisation plus replacement decisions for one tier.

    Required (vLLM's seed `CachePolicy`, nothing more): `__init__(cache_capacity)`, `get`,
    `insert`, `remove`, `touch`, `evict`. Everything else has a default, so a policy written to
    the seed's contract works unchanged (run it through `kvtier.testing.policy.PolicyTests`).

    Contract:
    - `get` finds a resident block, `insert` adds a newly allocated one, `remove` drops one
      (after a failed store; an absent key is a no-op), `touch` marks blocks as recently used
      (keys not resident are ignored; the first key of a prefix ends up the most recent, so a
      prefix is evicted tail first).
    - `evict(n, protected)` removes exactly `n` blocks whose `ref_cnt == 0` and whose key is not in
      `protected`, and returns them; if it cannot, it returns None and changes nothing.
    - `victim_candidates()` yields the evictable blocks in the order `evict` would take them now,
      without changing anything; the manager uses it to write blocks to the next tier before
      they are evicted. Policies that cannot predict this yield nothing (the default).
    - `keys()`, `len()` and `clear()` enumerate, count and forget the resident blocks. A policy
      that does not implement `keys` gets all three from `KeyIndex`, which `build_hierarchy` puts
      around it (see `with_key_index`); the defaults here derive `len` and `clear` from `keys`.
    - Evictable accounting (optional for the caller, built in for every policy): a caller that
      calls `track_pins()` promises to report, from then on, every resident block that stops
      being evictable (`pin(keys)`: inserted while being written, or its `ref_cnt` left 0) and
      every one that becomes evictable again (`unpin(keys)`: its `ref_cnt` reached 0). The policy
      then knows how many blocks are evictable, so `evict(n)` refuses in O(len(protected)) when
      fewer than `n` are (`_refuses`), whatever the number of pinned blocks, and a policy may take
      pinned blocks out of its eviction order (LRU does). Without `track_pins()` (a policy used
      on its own, the conformance suite) `pin`/`unpin` do nothing and `ref_cnt` is read as before.
    - Block objects: by default `get` returns the very object given to `insert`, and the caller
      may keep it and change its `ref_cnt` later. A policy that owns its data layout sets
      `returns_views = True`: `get` returns views of state the policy keeps (setting a view's
      `ref_cnt` changes what every later `get` sees), the objects passed to `insert` are copied
      and not updated later, and blocks are compared by `block_id`, not identity. A view is
      valid while its block stays resident; callers keep views only of pinned blocks, and settle
      blocks they inserted through `get` (see `kvtier.control.jobs.Job.finish`).
    - The block table: the slot-level calls the manager makes for a whole request (`readable_run`,
      `absent`, `insert_written`, `pin_loads`, `release_loads`, `mark_written`, `evict_ids`) are
      not a policy's: they are the tier's `kvtier.index.BlockTable`, which works through `get`,
      `insert_many`, `evict`, the blocks' `ref_cnt` and `pin`/`unpin` (`PolicyTable`), or, for
      a policy whose compiled index holds the blocks (`batch_calls = True`), is that index itself,
      answering the same calls in C with the same results (tests/policies/test_lru_batch.py).
    """

    returns_views: bool = False  # get() returns views of the policy's own state (see above)
    batch_calls: bool = False  # the compiled index is its own block table (see above)
    # The most blocks an instance can hold (None: no limit of its own); a tier's capacity is
    # checked against it by `config check` and the build (kvtier.core.limits).
    max_blocks: int | None = None
    # The longest key an instance holds, in bytes (None: no limit of its own); `insert` of a
    # longer one raises ValueError. Front-ends may refuse longer keys up front (as for backends).
    max_key_bytes: int | None = None
    _pinned: set[OffloadKey] | None = None  # resident keys not evictable; None: not tracking

    def __init__(self, cache_capacity: int) -> None:
        if cache_capacity <= 0:
            raise ValueError(f"cache_capacity must be > 0 blocks, got {cache_capacity}")
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockStatus | None:
        """The resident block for `key`, or None."""

    @abstractmethod
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        """Add a newly allocated block (not resident before)."""

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    tail: OffloadKey | None = None) -> None:
        """`insert(keys[i], blocks[i])` for each i, in order. Policies override it with a bulk
        version where that is faster; without `tail` the result must equal the loop's.

        `tail` says which of `keys` is the last block of a request: the manager passes a
        request's new blocks tail first with `tail=keys[0]` (engine stores), and no tail for
        copies between tiers (demotions, promotions). A policy that treats request tails
        differently (`prefix-freq` evicts them first while they look one-time) uses it; every
        other policy accepts and ignores it."""
        insert = self.insert
        for key, block in zip(keys, blocks):
            insert(key, block)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a resident block without recording it as evicted; an absent key is a no-op."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark resident blocks as recently used; keys not resident are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Evict exactly `n` unpinned, unprotected blocks, or return None and change nothing."""

    def victim_candidates(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Evictable blocks in the order `evict` would choose them now (no state change).
        Default: nothing (the policy does not predict its choices)."""
        return iter(())

    def victim_keys(self, n: int, protected: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        """The keys of the first `n` blocks `evict(n, protected)` would take now, in its order
        (all of them when there are fewer), as a list: those `victim_candidates` yields that are
        not `protected`. Policies override it with C loops where that is faster, and where
        `protected` changes their order (ARC)."""
        keys = map(_first, self.victim_candidates())
        return list(islice(filterfalse(protected.__contains__, keys) if protected else keys, max(n, 0)))

    # ------------------------------------------------------------------ evictable accounting
    def track_pins(self) -> None:
        """Start evictable accounting: the caller will report `pin`/`unpin` from now on (see the
        class docstring). The blocks resident now are classified once by their `ref_cnt`."""
        get = self.get
        self._pinned = {k for k in self.keys() if (b := get(k)) is not None and b.ref_cnt != 0}

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        """Resident blocks `keys` are not evictable any more (being written, or read by a copy)."""
        if self._pinned is not None:
            self._pinned.update(keys)

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        """Resident blocks `keys` became evictable again (their `ref_cnt` reached 0)."""
        if self._pinned is not None:
            self._pinned.difference_update(keys)

    def pinned_keys(self) -> set[OffloadKey] | None:
        """The resident keys counted as not evictable (a new set), or None when pins are not
        tracked: for checks and inspection, not the request path."""
        return None if self._pinned is None else set(self._pinned)

    def _forget_pin(self, key: OffloadKey) -> None:
        """A key left the tier (`remove`): it is no longer counted as pinned."""
        if self._pinned:
            self._pinned.discard(key)

    def evictable_count(self, protected: Collection[OffloadKey] = ()) -> int | None:
        """How many resident blocks `evict` could take now, not counting `protected`; None when
        pins are not tracked. O(1), plus O(len(protected)) when that could matter."""
        pinned = self._pinned
        if pinned is None:
            return None
        free = len(self) - len(pinned)
        if protected:
            get = self.get
            free -= sum(1 for k in protected if k not in pinned and get(k) is not None)
        return free

    def _refuses(self, n: int, protected: Collection[OffloadKey]) -> bool:
        """Whether evictable accounting proves that `evict(n, protected)` must return None
        (False when pins are not tracked: the policy finds out by looking)."""
        pinned = self._pinned
        if pinned is None:
            return False
        free = len(self) - len(pinned)
        if free >= n + len(protected):
            return False
        count = self.evictable_count(protected)
        return count is not None and count < n

    def keys(self) -> Iterable[OffloadKey]:
        """Resident keys, in no particular order. Not derivable from the seed's methods: a policy
        that does not override it is wrapped in `KeyIndex` by `with_key_index`."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement keys(); wrap it with "
            f"kvtier.policies.base.with_key_index() (build_hierarchy does this)")

    def __len__(self) -> int:
        """Number of resident blocks (default: counted from `keys`)."""
        return sum(1 for _ in self.keys())

    def clear(self) -> None:
        """Forget every resident block (default: `remove` each key of `keys`). Policies with
        history (ghost lists, frequencies) override it to forget that too."""
        for key in list(self.keys()):
            self.remove(key)


class KeyIndex(CachePolicy):
    """A policy written to the seed contract (`get/insert/remove/touch/evict` only), completed
    with `keys`, `len` and `clear` by recording the keys that go in (`insert`) and out (`remove`,
    `evict`). Every other call goes to the wrapped policy unchanged, so decisions and block
    objects are exactly the wrapped policy's.

    `clear` removes every resident block through the wrapped `remove`; history the seed contract
    cannot reach (such as ARC's ghost lists) stays."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.cache_capacity = int(getattr(policy, "cache_capacity", 0))  # 0: the wrapped policy does not say
        self._resident: dict[OffloadKey, None] = {}
        self.returns_views = bool(getattr(policy, "returns_views", False))

    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.policy.get(key)

    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.policy.insert(key, block)
        self._resident[key] = None

    def insert_many(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    tail: OffloadKey | None = None) -> None:
        insert_many = getattr(self.policy, "insert_many", None)
        if insert_many is None:
            for key, block in zip(keys, blocks):
                self.policy.insert(key, block)
        elif isinstance(self.policy, CachePolicy):
            insert_many(keys, blocks, tail=tail)
        else:
            insert_many(keys, blocks)  # vLLM's seed contract knows no tails
        self._resident.update(dict.fromkeys(keys))

    def remove(self, key: OffloadKey) -> None:
        self.policy.remove(key)
        self._resident.pop(key, None)
        self._forget_pin(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.policy.touch(keys)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        if self._refuses(n, protected):
            return None
        victims = self.policy.evict(n, protected)
        for key, _block in victims or ():
            self._resident.pop(key, None)
        return victims

    def victim_candidates(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        candidates = getattr(self.policy, "victim_candidates", None)
        return iter(()) if candidates is None else candidates()

    def keys(self) -> Iterable[OffloadKey]:
        return list(self._resident)

    def __len__(self) -> int:
        return len(self._resident)

    def clear(self) -> None:
        super().clear()
        if self._pinned is not None:
            self._pinned.clear()

    def __repr__(self) -> str:
        return f"KeyIndex({self.policy!r})"


def predicts_victims(policy: Any) -> bool:
    """Whether `policy` implements `victim_candidates` (the default yields nothing); a tier that
    cascades `on_evict` needs it to copy blocks down before they are evicted."""
    if isinstance(policy, KeyIndex):
        return predicts_victims(policy.policy)
    if isinstance(policy, CachePolicy):
        return type(policy).victim_candidates is not CachePolicy.victim_candidates
    return callable(getattr(policy, "victim_candidates", None))


def with_key_index(policy: Any) -> CachePolicy:
    """`policy` itself if it is a `CachePolicy` that implements `keys`, else `KeyIndex(policy)`
    (a seed-contract policy, whether it subclasses this class or vLLM's)."""
    if isinstance(policy, CachePolicy) and type(policy).keys is not CachePolicy.keys:
        return policy
    return KeyIndex(policy)


def evictable(entries: Iterable[tuple[OffloadKey, BlockStatus]], protected: Collection[OffloadKey]):
    """Filter `(key, block)` pairs to those that may be evicted now."""
    for key, block in entries:
        if block.ref_cnt == 0 and key not in protected:
            yield key, block
