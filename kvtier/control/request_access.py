"""Per-request cache accesses, recorded the way vLLM 0.32's `CPUOffloadingManager` records them.

vLLM's manager does not change a block's recency when a request reads it. It records, per
request, the keys the request loaded (`prepare_load`) and the keys it offered to `prepare_store`
that were either stored for it or already readable, once each, and applies them to the policy
once, when the request finishes (`on_request_finished`): in the request's head-to-tail order
(the key positions vLLM's scheduler records in its `ReqContext`, the groups one after another
where a position is missing), so that the request's head ends up the most recently used.

A key is *reused* by a request when it was readable and the request loaded it or offered it
again, unless the request itself stored it (re-reading one's own block is not a second access).
A key the request stored and never reused is *insertion-only*.

`RequestAccesses` holds that record for kvtier's front-ends (the vLLM adapter, the
`LRUOffloadingManager`), which turn it into one `touch` at the request's end (`finish`). Pure
logic: no vLLM import; a `ReqContext` without positions (kvtier's own) orders the keys by group,
then as first seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Generic, TypeVar

from kvtier.core.keys import GROUP_BYTES

# The group index's bytes of a key (C-level `map` over a request's keys).
group_bytes = itemgetter(slice(-GROUP_BYTES, None))
# kvtier's `OffloadKey` or vLLM's (the same bytes: a block hash, then the 4-byte group index)
K = TypeVar("K", bound=bytes)


@dataclass(slots=True)
class RequestAccess(Generic[K]):
    """The keys one request observed, in the order first seen, and which of them it stored and
    which it reused."""

    observed: dict[K, None] = field(default_factory=dict)  # (an ordered set)
    inserted: set[K] = field(default_factory=set)
    reused: set[K] = field(default_factory=set)


def request_order(keys: Iterable[K], req_context: Any) -> list[K]:
    """`keys` in the request's head-to-tail order, as vLLM's `order_request_keys` orders them:
    grouped by KV-cache group (lowest index first, each group in the given order), then sorted
    by the end-token position the scheduler recorded for each key (a stable sort, so keys of
    several groups at one position stay in group order). Without a position for every key, the
    grouped order."""
    return _by_position(_grouped(keys), req_context)


def several_groups(keys: Iterable[bytes]) -> bool:
    """Whether `keys` name more than one KV-cache group (only a hybrid model's do)."""
    return len(set(map(group_bytes, keys))) > 1


def _grouped(keys: Iterable[K]) -> list[K]:
    """`keys` one KV-cache group after another, lowest index first, each group in the given order
    (the index is big-endian and of fixed width, so its bytes sort as the number does)."""
    keys = list(keys)
    if not keys:
        return keys
    if not several_groups(keys):
        return keys
    groups: dict[bytes, list[K]] = {}
    for key in keys:
        groups.setdefault(key[-GROUP_BYTES:], []).append(key)
    return [key for suffix in sorted(groups) for key in groups[suffix]]


def _by_position(keys: list[K], req_context: Any) -> list[K]:
    """`keys` stably sorted by their recorded positions, when every key has one."""
    position = getattr(req_context, "get_offload_key_position", None)
    if position is None or len(keys) < 2:
        return keys
    positions = list(map(position, keys))
    if None in positions:
        return keys
    in_order = sorted(positions)
    if positions == in_order:  # (usually: a request's keys arrive head first)
        return keys
    return [keys[i] for i in sorted(range(len(keys)), key=positions.__getitem__)]


class RequestAccesses(Generic[K]):
    """Open requests' access records, by request id (see the module docstring).

    Contract: `record` as the request's calls arrive; `finish` once, at the request's end, returns
    the keys to touch and forgets the request; `clear` (a cache reset) forgets every request, so
    that a request's accesses from before a reset are never applied after it (vLLM's cache
    generation)."""

    def __init__(self) -> None:
        self._requests: dict[str, RequestAccess[K]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, req_context: Any) -> RequestAccess[K]:
        """The record of `req_context`'s request, created empty on its first call."""
        access = self._requests.get(req_context.req_id)
        if access is None:
            access = self._requests[req_context.req_id] = RequestAccess[K]()
        return access

    def record(self, keys: Iterable[K], req_context: Any, reused: Iterable[K] = ()) -> None:
        """Note that the request observed `keys`; `reused` of them were readable and read or
        offered again (those the request stored itself do not count). A call of no request
        (`req_context` None: vLLM's earlier call forms) is recorded nowhere."""
        if req_context is None:
            return
        access = self.get(req_context)
        access.observed.update(dict.fromkeys(keys))
        if access.inserted:
            access.reused.update(set(reused).difference(access.inserted))
        else:
            access.reused.update(reused)

    def inserted(self, keys: Iterable[K], req_context: Any) -> None:
        """Note that `keys` were stored for the request (allocated by its `prepare_store`); none
        for a call of no request."""
        if req_context is not None:
            self.get(req_context).inserted.update(keys)

    def finish(self, req_context: Any, *, insertions: bool) -> list[K]:
        """Forget the request and return, in its head-to-tail order (`request_order`), the keys
        its end touches: those it reused and, with `insertions` (a policy for which a touch is
        recency only, such as LRU), every key it observed, as vLLM's LRU applies them. Empty for
        a request with no record (finished already, or recorded before a reset)."""
        access = None if req_context is None else self._requests.pop(req_context.req_id, None)
        if access is None:
            return []
        keys = _grouped(access.observed)
        if not insertions:
            keys = [key for key in keys if key in access.reused]
        return _by_position(keys, req_context)

    def clear(self) -> None:
        """Forget every open request (`reset_cache`)."""
        self._requests.clear()
