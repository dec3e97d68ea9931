"""The block table of a tier: key -> slot, block state and load pins, behind one batch API over
slot ids (`BlockTable`). It is the one writer of that state: the control plane reads and
changes blocks only through it, and the eviction order is told what it needs (`evictable`).

A block is *being written* (`ref_cnt == -1`: its slot is allocated, its bytes are not there
yet), *readable* (`ref_cnt == 0`) or *pinned* by `n` running loads or copies (`ref_cnt == n`).
A block may also be *held* (`hold`: a session's retention keeps it), which takes it out of
eviction like a pin whatever its `ref_cnt`, until the hold is released.
Every call takes or returns keys and slot ids (`block_id`s) in the order given.

Two tables, each composed with an order that only orders keys, held to the same answers and side
effects by tests/policies/test_lru_batch.py and tests/test_manager_bulk.py:
- the compiled table (`kvtier/index/_table.pxd`/`_table.pyx`, `_table_api.pyx`: `CompactTable`)
  with a compiled order: the compiled `lru` and `prefix-freq` (`CachePolicy.batch_calls`);
- its pure-Python twin (`kvtier.index.pure.PureTable`) with a pure `Order`: the pure `lru` and
  `prefix-freq`, ARC and SIEVE (`kvtier.policies.pure.PurePolicy`).
A policy written to vLLM's `CachePolicy` contract stores its own `BlockStatus` objects: `PolicyTable`
is the one adapter that makes it a block table. The two Python tables make their reads and
`ref_cnt` changes through one piece of code (`kvtier.index.status.StatusCalls`).

`table_of(policy)` gives the table a tier uses and starts its evictable accounting. Both
implementations also answer `pinned_keys()`, the resident keys not evictable now (pinned or
held; a new set), for checks rather than the request path.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Protocol, cast

from kvtier.core.errors import PolicyError
from kvtier.core.keys import OffloadKey
from kvtier.core.quoting import brief, clip
from kvtier.core.types import BlockStatus
from kvtier.index.pure import PureTable
from kvtier.index.status import StatusCalls


class BlockTable(Protocol):
    """Per tier: which keys are resident, in which slot, in which state (see the module)."""

    def get(self, key: OffloadKey) -> BlockStatus | None:
        """The resident block of `key` (its `block_id` and `ref_cnt`; read it, do not change it), or None."""

    def keys(self) -> Iterable[OffloadKey]:
        """The resident keys."""

    def __len__(self) -> int:
        """How many blocks are resident."""

    def readable_run(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading `keys` are resident and readable (`ref_cnt >= 0`)."""

    def absent(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The `keys` not resident, in order."""

    def insert_written(self, keys: Sequence[OffloadKey], block_ids: Sequence[int],
                       tail: OffloadKey | None = None) -> None:
        """Add new blocks being written (`ref_cnt == -1`) in slots `block_ids`; `tail`: which of
        `keys` ends a request (see `CachePolicy.insert_many`)."""

    def insert_ready(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        """Add new readable blocks (recovered, or found in a shared tier) in slots `block_ids`."""

    def pin_loads(self, keys: Sequence[OffloadKey]) -> list[int] | None:
        """When every key is resident and readable, pin each once more for reading (a key given
        twice: twice) and return their slots in order; otherwise change nothing, return None."""

    def release_loads(self, keys: Sequence[OffloadKey]) -> None:
        """Undo `pin_loads(keys)`; KeyError (nothing changed) if a key is not resident."""

    def mark_written(self, keys: Sequence[OffloadKey]) -> bool:
        """When every key is resident, being written and given once, make them readable and
        return True; otherwise change nothing and return False."""

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """Remove resident blocks, whatever their state, not as evictions; absent keys are skipped."""

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """The blocks `keys` were used (`CachePolicy.touch`)."""

    def evict_ids(self, n: int, protected: set[OffloadKey]) -> tuple[list[OffloadKey], list[int]] | None:
        """Evict exactly `n` readable, unpinned blocks not in `protected` (the policy picks
        them); their keys and slots, or None (nothing changed) when there are fewer."""

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        """The keys `evict_ids(n, skip)` would take now, in order (`CachePolicy.victims`)."""

    def evictable_count(self, protected: Collection[OffloadKey] = ()) -> int | None:
        """How many blocks `evict_ids` could take now, not counting `protected`; O(1) plus
        O(len(protected)). None only before the accounting started (see `table_of`)."""

    def hold(self, keys: Iterable[OffloadKey], held: bool = True) -> None:
        """Keep the resident `keys` from eviction, whatever their `ref_cnt`, until held again
        with `held` False (a session's retention, kvtier.control.retention): counted as pinned,
        left out of `victims` and `evict_ids`. With `held` False each held key is evictable again
        once no load or write pins it. Absent keys are skipped; O(1) per key."""


class PolicyTable(StatusCalls):
    """The `BlockTable` over a policy written to vLLM's contract, whose blocks are its own
    `BlockStatus` objects (`get`): a user's policy (kvtier's own are composed with a table of
    their own, `table_of`). It counts the blocks that are not evictable (being written or
    pinned) and tells the policy of each change (`CachePolicy.evictable`); the first notice, sent
    here, starts the policy's accounting.

    It does not trust the policy's `evict`: it records which block each resident key has
    (`_blocks`) and checks every answer before a slot is freed (`evict_ids`)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.get = policy.get  # type: ignore[method-assign]  # hot path: the policy's own lookup
        get = policy.get
        # key -> the block the table gave the policy (its slot; `ref_cnt` too unless `returns_views`)
        self._blocks: dict[OffloadKey, BlockStatus] = {k: b for k in policy.keys() if (b := get(k)) is not None}
        self._pinned: set[OffloadKey] = {k for k, b in self._blocks.items() if b.ref_cnt != 0}
        self._held: set[OffloadKey] = set()  # `hold`: pinned whatever their ref_cnt
        self._notice = getattr(policy, "evictable", _ignore)
        self._notice((), False)

    def keys(self) -> Iterable[OffloadKey]:
        return self.policy.keys()

    def __len__(self) -> int:
        return len(self.policy)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.policy.touch(keys)

    def victims(self, n: int, skip: Collection[OffloadKey] = ()) -> list[OffloadKey]:
        victims = getattr(self.policy, "victims", None)
        if victims is None:
            return []
        return victims(n, self._held.union(skip) if self._held else skip)  # (a policy may not take notices)

    def hold(self, keys: Iterable[OffloadKey], held: bool = True) -> None:
        get, holding = self.policy.get, self._held
        if held:
            new = [k for k in keys if k not in holding and get(k) is not None]
            holding.update(new)
            self._pin([k for k in new if k not in self._pinned])
            return
        gone = [k for k in keys if k in holding]
        holding.difference_update(gone)
        self._unpin([k for k in gone if (b := get(k)) is not None and b.ref_cnt == 0])

    def _pin(self, keys: Sequence[OffloadKey]) -> None:
        newly = [key for key in keys if key not in self._pinned]
        self._pinned.update(newly)
        try:
            self._notice(keys, False)
        except BaseException:  # (the caller undoes its ref_cnt change: the keys are as before)
            self._pinned.difference_update(newly)
            raise

    def _unpin(self, keys: Sequence[OffloadKey]) -> None:
        if self._held:  # (a held block stays pinned when its last load or write ends)
            keys = [k for k in keys if k not in self._held]
        self._pinned.difference_update(keys)
        self._notice(keys, True)

    def _insert(self, keys: Sequence[OffloadKey], blocks: list[BlockStatus], tail: OffloadKey | None) -> None:
        try:
            self.policy.insert_many(keys, blocks, tail=tail)
        except BaseException:  # (the keys it did take are resident: the caller forgets them)
            get = self.policy.get
            self._blocks.update((k, b) for k, b in zip(keys, blocks) if get(k) is not None)
            raise
        self._blocks.update(zip(keys, blocks))

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        self._held.difference_update(keys)
        self._unpin(keys)  # (leaving, it is not counted as pinned any more)
        pop = self._blocks.pop
        for key in keys:
            self.policy.remove(key)
            pop(key, None)

    def evict_ids(self, n: int, protected: set[OffloadKey]) -> tuple[list[OffloadKey], list[int]] | None:
        """`BlockTable.evict_ids`, the policy's answer checked before anything is freed: None, or
        a list of exactly `n` `(key, block)` pairs naming distinct resident keys with the blocks
        the table gave them, none pinned, held or in `protected`, each removed from the policy,
        which removed nothing else. A wrong answer frees nothing: the blocks the policy dropped
        are inserted in it again (pinned ones with a notice, `evictable(keys, False)`) and
        `PolicyError` names the tier, the policy's class and what was wrong; the call that needed
        the room fails with it, as no fallback could trust the policy's order."""
        if n > 0 and self._refuses(n, protected):
            return None
        if self._held:
            protected = self._held.union(protected)
        victims = self.policy.evict(n, protected)
        problem = self._wrong_answer(victims, n, protected)
        if problem:
            raise self._refused(f"evict({n}) {problem}")
        if victims is None:
            return None
        pop = self._blocks.pop
        for key, _ in victims:
            pop(key)
        return [key for key, _ in victims], [block.block_id for _, block in victims]

    def _wrong_answer(self, victims: Any, n: int, protected: Collection[OffloadKey]) -> str:
        """What is wrong with `victims`, the policy's answer to `evict(n, protected)` ("" if nothing)."""
        if victims is None:
            gone = len(self._blocks) - len(self.policy)
            return f"returned None (no room) but removed {gone} block(s)" if gone else ""
        if not isinstance(victims, (list, tuple)):
            return f"returned {brief(victims)}, not a list of (key, block) pairs"
        if len(victims) != n:
            return f"returned {len(victims)} block(s), not {n}"
        named: set[OffloadKey] = set()
        for i, victim in enumerate(victims):
            problem = self._wrong_victim(victim, named, protected)
            if problem:
                return f"{problem} (victim [{i}])"
            named.add(victim[0])
        left = len(self.policy)
        if left != len(self._blocks) - n:
            return f"named {n} block(s) but {len(self._blocks) - left} left it"
        return ""

    def _wrong_victim(self, victim: Any, named: set[OffloadKey], protected: Collection[OffloadKey]) -> str:
        """What is wrong with one pair of an `evict` answer ("" if nothing); `named`: the keys before it."""
        if not isinstance(victim, tuple) or len(victim) != 2:
            return f"returned {brief(victim)}, not a (key, block) pair"
        key, block = victim
        mine = self._blocks.get(OffloadKey(key)) if isinstance(key, bytes) else None
        if mine is None:
            return f"named key {_key(key)}, which is not resident"
        if key in named:
            return f"named key {_key(key)} twice"
        if getattr(block, "block_id", None) != mine.block_id:
            return f"named key {_key(key)} with {brief(block)}, but its block is in slot {mine.block_id}"
        if key in self._pinned:
            return f"named key {_key(key)}, which is pinned (being written, read or held)"
        if key in protected:
            return f"named key {_key(key)}, which is protected"
        if self.policy.get(key) is not None:
            return f"named key {_key(key)} but still holds it"
        return ""

    def _refused(self, problem: str) -> PolicyError:
        """The error for a wrong `evict` answer (`problem`), once the blocks the policy dropped
        are back in it (`_restore`); the tier adds its own name (`Tier.evict`)."""
        text = f"policy {_policy_name(self.policy)}.{problem}; a policy must return None or " \
               "exactly n distinct (key, block) pairs of resident, unpinned blocks not in protected, removed from it"
        try:
            self._restore()
        except Exception as exc:  # (a policy that also fails to take its blocks back)
            text += f" (putting its blocks back failed too: {type(exc).__name__}: {clip(str(exc))})"
        return PolicyError(text)

    def _restore(self) -> None:
        """Insert again in the policy each block of the table it no longer holds, as it was: the
        same `BlockStatus` (readable again when not pinned, for a policy that `returns_views`),
        and a notice (`evictable(keys, False)`) for the pinned ones. O(resident), after an error only."""
        get = self.policy.get
        lost = [(key, block) for key, block in self._blocks.items() if get(key) is None]
        if not lost:
            return
        pinned = [key for key, _ in lost if key in self._pinned]
        if getattr(self.policy, "returns_views", False):
            for key, block in lost:
                if key not in self._pinned:
                    block.ref_cnt = 0
        self.policy.insert_many([key for key, _ in lost], [block for _, block in lost], tail=None)
        if pinned:
            self._notice(pinned, False)

    def _refuses(self, n: int, protected: Collection[OffloadKey]) -> bool:
        """Whether the count proves `evict_ids(n, protected)` must refuse (O(1) unless close)."""
        free = len(self.policy) - len(self._pinned)
        return free < n + len(protected) and cast(int, self.evictable_count(protected)) < n

    def evictable_count(self, protected: Collection[OffloadKey] = ()) -> int | None:
        pinned = self._pinned
        free = len(self.policy) - len(pinned)
        if protected:
            get = self.policy.get
            free -= sum(1 for k in protected if k not in pinned and get(k) is not None)
        return free

    def pinned_keys(self) -> set[OffloadKey] | None:
        return set(self._pinned)

    def __repr__(self) -> str:
        return f"PolicyTable({self.policy!r})"


def _key(key: Any) -> str:
    """A key in an error message: its bytes in hex."""
    return key.hex() if isinstance(key, bytes) and len(key) <= 64 else brief(key)


def _policy_name(policy: Any) -> str:
    """`module:Class` of the policy a user named (the one a `kvtier.policies.base.KeyIndex` wraps:
    named here, not imported, as the block table sits below the policies)."""
    cls = type(policy)
    if (cls.__module__, cls.__qualname__) == ("kvtier.policies.base", "KeyIndex"):
        cls = type(policy.policy)
    return f"{cls.__module__}:{cls.__qualname__}"


def _ignore(keys: Iterable[OffloadKey], flag: bool) -> None:
    """The notice of a policy that takes none (written to vLLM's five methods)."""


def table_of(policy: Any) -> BlockTable:
    """The block table of a tier whose policy is `policy`, with its evictable accounting started:
    the table a compiled or pure policy is composed of (`policy.table`: a `CompactTable`, with
    `batch_calls`, or a `PureTable`, with `composed`), else a `PolicyTable` over it."""
    table: Any = getattr(policy, "table", None)
    if getattr(policy, "batch_calls", False) or (isinstance(table, PureTable) and policy.composed):
        table.evictable((), False)
        return cast(BlockTable, table)
    return PolicyTable(policy)
