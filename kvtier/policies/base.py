"""`CachePolicy`: decides which blocks leave a tier. Pure Python; knows nothing of bytes or slots."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence
from itertools import filterfalse, islice
from operator import itemgetter
from typing import Any

from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus

_first = itemgetter(0)


class CachePolicy(ABC):
    """Replacement decisions for one tier: which resident blocks leave first.

    Required (vLLM's `CachePolicy` contract, nothing more): `__init__(cache_capacity)`, `get`,
    `insert`, `remove`, `touch`, `evict`. The rest has defaults, so a policy written to vLLM's
    contract works unchanged (run it through `kvtier.testing.policy.PolicyTests`).

    - `get`/`insert`/`remove`/`touch`/`evict` are vLLM's (see each method). `insert_many` adds a
      request's blocks at once and says which one ends it (`tail`).
    - `victims(n, skip)` names the keys `evict(n, skip)` would take now, in its order, changing
      nothing; a tier that cascades `on_evict` copies them down first. The default names none
      (the policy does not predict its choices).
    - `evictable(keys, flag)` is the block table's notice that resident blocks stopped
      (`False`: being written, or read by a copy) or started (`True`: their `ref_cnt` reached 0)
      being evictable. The table (`kvtier.index`) owns that state and counts it; a policy may use
      the notices to take pinned blocks out of its order (LRU and prefix-freq do).
    - kvtier's own policies store no blocks: each is a block table composed with an order over
      keys (`kvtier.index.PureTable` and `Order`, or the compiled pair). A policy written to
      vLLM's contract stores the `BlockStatus` objects it is given; `PolicyTable` adapts it.
    - `keys()`, `len()` and `clear()` enumerate, count and forget the resident blocks; a policy
      without `keys` is wrapped in `KeyIndex` (`with_key_index`, done by `build_hierarchy`).
    - By default `get` returns the object given to `insert`. A policy that owns its data layout
      sets `returns_views`: `get` returns views of its own state, compared by `block_id`.
    """

    returns_views: bool = False  # get() returns views of the policy's own state (see above)
    batch_calls: bool = False  # the compiled table (`table`) answers the block table's calls itself (kvtier.index)
    # The most blocks an instance can hold (None: no limit of its own); a tier's capacity is
    # checked against it by `config check` and the build (kvtier.core.limits).
    max_blocks: int | None = None
    # The longest key an instance holds, in bytes (None: no limit of its own); `insert` of a
    # longer one raises ValueError. Front-ends may refuse longer keys up front (as for backends).
    max_key_bytes: int | None = None
    _pinned: set[OffloadKey] | None = None  # the table's notices so far (None: none yet)

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
        """`insert(keys[i], blocks[i])` for each i, in order (without `tail`, the same result).

        `tail` says which of `keys` is the last block of a request: engine stores pass a
        request's new blocks tail first with `tail=keys[0]`, copies between tiers pass none.
        A policy may treat tails apart (`prefix-freq` evicts them first while they look
        one-time); the others ignore it."""
        insert = self.insert
        for key, block in zip(keys, blocks):
            insert(key, block)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a resident block without recording it as evicted; an absent key is a no-op."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Record a reuse of the resident blocks `keys`. The manager passes a request's hits in
        prefix order, head first.

        Every policy (`PolicyTests` checks it): keys not resident are ignored; no resident block
        is dropped or replaced; a touched block outlives blocks stored once and never touched
        (a suite may declare `keeps_hit_blocks = False` for a policy that does not promise it,
        e.g. FIFO).

        Recency-ordered policies (`lru`, `arc`, the recency part of `prefix-freq`, vLLM's LRU)
        also move the touched blocks to the most recent end, the first key last: it ends up the
        most recent, so a touched prefix is evicted tail first. That order is theirs, not the
        contract's: `sieve` only sets each block's visited bit and moves nothing (SIEVE by
        design), so touched blocks keep their insertion order and a prefix's head may be evicted
        before its tail."""

    @abstractmethod
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Evict exactly `n` blocks with `ref_cnt == 0` not in `protected` and return them, or
        return None and change nothing."""

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        """The keys of the first `n` blocks `evict(n, skip)` would take now, in its order (all of
        them when there are fewer), changing nothing. Default: none (no prediction)."""
        return []

    def evictable(self, keys: Iterable[OffloadKey], flag: bool) -> None:
        """The block table's notice: resident blocks `keys` stopped (`flag` False) or started
        (True) being evictable. The first notice starts the accounting: the blocks resident then
        with `ref_cnt != 0` count as not evictable, and from then on every change is notified.
        Default: kept in `_pinned`, so `evict` can refuse early (`_refuses`)."""
        pinned = self._pinned
        if pinned is None:
            get = self.get
            pinned = self._pinned = {k for k in self.keys() if (b := get(k)) is not None and b.ref_cnt != 0}
        if flag:
            pinned.difference_update(keys)
        else:
            pinned.update(keys)

    def _forget_pin(self, key: OffloadKey) -> None:
        """A key left the tier (`remove`): it is no longer counted as pinned."""
        if self._pinned:
            self._pinned.discard(key)

    def _refuses(self, n: int, protected: Collection[OffloadKey]) -> bool:
        """Whether the notices prove that `evict(n, protected)` must return None (False before
        the first notice: the policy finds out by looking). O(len(protected)) at most."""
        pinned = self._pinned
        if pinned is None:
            return False
        free = len(self) - len(pinned)
        if free >= n + len(protected):
            return False
        get = self.get
        return free - sum(1 for k in protected if k not in pinned and get(k) is not None) < n

    def keys(self) -> Iterable[OffloadKey]:
        """Resident keys, in no particular order. Not derivable from vLLM's five methods: a policy
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
        if self._pinned is not None:
            self._pinned.clear()


class OnTable:
    """vLLM's calls that a policy composed with a block table (`table`: kvtier.policies.compiled,
    kvtier.policies.pure) answers through it."""

    table: Any

    def remove(self, key: OffloadKey) -> None:
        self.table.remove(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.table.touch(keys)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]] | None:
        return self.table.evict(n, protected)

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        return self.table.victims(n, skip)

    def evictable(self, keys: Iterable[OffloadKey], flag: bool) -> None:
        self.table.evictable(keys, flag)

    def keys(self) -> Iterable[OffloadKey]:
        return self.table.keys()

    def clear(self) -> None:
        self.table.clear()

    def __len__(self) -> int:
        return len(self.table)


def first_keys(candidates: Iterable[tuple[OffloadKey, BlockStatus]], n: int,
               skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
    """`victims` from `(key, block)` pairs in eviction order: the first `n` keys not in `skip`."""
    keys = map(_first, candidates)
    return list(islice(filterfalse(skip.__contains__, keys) if skip else keys, max(n, 0)))


class KeyIndex(CachePolicy):
    """A policy written to vLLM's contract (`get/insert/remove/touch/evict` only), completed
    with `keys`, `len` and `clear` by recording the keys that go in (`insert`) and out (`remove`,
    `evict`). Every other call goes to the wrapped policy unchanged, so decisions and block
    objects are exactly the wrapped policy's.

    `clear` removes every resident block through the wrapped `remove`; history those five methods
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
            insert_many(keys, blocks)  # vLLM's contract knows no tails
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
        if isinstance(victims, (list, tuple)):
            # (only the keys the wrapped policy let go: the block table checks the answer and
            # puts back what a wrong one dropped, kvtier.index.PolicyTable.evict_ids)
            get, resident = self.policy.get, self._resident
            for victim in victims:
                key = victim[0] if isinstance(victim, tuple) and len(victim) == 2 else None
                if isinstance(key, bytes) and key in resident and get(key) is None:
                    del resident[OffloadKey(key)]
        return victims

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        victims = getattr(self.policy, "victims", None)
        return [] if victims is None else victims(n, skip)

    def evictable(self, keys: Iterable[OffloadKey], flag: bool) -> None:
        keys = list(keys)
        notice = getattr(type(self.policy), "evictable", None)
        if notice is not None and notice is not CachePolicy.evictable:  # (the default needs `keys`)
            self.policy.evictable(keys, flag)  # (first: when it raises, this index's count is unchanged)
        super().evictable(keys, flag)

    def keys(self) -> Iterable[OffloadKey]:
        return list(self._resident)

    def __len__(self) -> int:
        return len(self._resident)

    def __repr__(self) -> str:
        return f"KeyIndex({self.policy!r})"


def predicts_victims(policy: Any) -> bool:
    """Whether `policy` implements `victims` (the default names none); a tier that cascades
    `on_evict` needs it to copy blocks down before they are evicted."""
    if isinstance(policy, KeyIndex):
        return predicts_victims(policy.policy)
    if isinstance(policy, CachePolicy):
        return type(policy).victims is not CachePolicy.victims
    return callable(getattr(policy, "victims", None))


def class_predicts_victims(cls: Any) -> bool:
    """`predicts_victims` of the policies of class `cls`, before one is made (a config's check)."""
    if isinstance(cls, type) and issubclass(cls, CachePolicy):
        return cls.victims is not CachePolicy.victims
    return callable(getattr(cls, "victims", None))


def with_key_index(policy: Any) -> CachePolicy:
    """`policy` itself if it is a `CachePolicy` that implements `keys`, else `KeyIndex(policy)`
    (a policy written to vLLM's five methods, whether it subclasses this class or vLLM's)."""
    if isinstance(policy, CachePolicy) and type(policy).keys is not CachePolicy.keys:
        return policy
    return KeyIndex(policy)


def evictable(entries: Iterable[tuple[OffloadKey, BlockStatus]], protected: Collection[OffloadKey]):
    """Filter `(key, block)` pairs to those that may be evicted now."""
    for key, block in entries:
        if block.ref_cnt == 0 and key not in protected:
            yield key, block
