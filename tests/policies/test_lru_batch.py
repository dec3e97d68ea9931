"""The block table's calls (`kvtier.index.BlockTable`: `readable_run`, `absent`, `insert_written`,
`pin_loads`, `release_loads`, `mark_written`, `evict_ids`): the compiled table of `lru`
(`CompactTable` with its compiled order), the pure-Python table (`PureTable` with the pure LRU
order: `PureLRUCachePolicy` and the fallback) and `PolicyTable`, which goes key by key through
`get`, `insert_many`, `evict`, the blocks' `ref_cnt` and `pin`/`unpin` of a policy that overrides
vLLM's calls (`AdaptedLRU`), give exactly the same answers and side effects. Batches repeat keys
and mix resident, absent, pinned and unwritten blocks, with and without evictable accounting, so
refusals (nothing changed) are reached as often as the common case."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.core.types import BlockStatus
from kvtier.index import PolicyTable, PureTable, table_of
from kvtier.policies.lru_compiled import FallbackLRUCachePolicy, LRUCachePolicy
from kvtier.policies.lru_pure import PureLRUCachePolicy
from tests.support.policy_state import evictable_count_of, pinned_of


class AdaptedLRU(PureLRUCachePolicy):
    """The pure LRU with one of vLLM's calls overridden: its tier goes through `PolicyTable`."""

    def touch(self, keys) -> None:
        super().touch(keys)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def state(p) -> tuple:
    pinned = pinned_of(p)
    return (sorted((k, p.get(k).block_id, p.get(k).ref_cnt) for k in p.keys()),
            p.victims(len(p)), None if pinned is None else sorted(pinned),
            evictable_count_of(p))


BATCH = st.lists(st.integers(0, 11), max_size=6)
OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 11), max_size=4), st.sampled_from([-1, 0])),
    st.tuples(st.just("insert_written"), st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.sampled_from(["readable_run", "absent", "pin_loads", "release_loads", "mark_written"]), BATCH),
    st.tuples(st.just("evict"), st.integers(1, 3)),
    st.tuples(st.just("evict_ids"), st.integers(0, 3), st.lists(st.integers(0, 11), max_size=2)),
    st.tuples(st.just("touch"), BATCH),
    st.tuples(st.just("remove"), st.integers(0, 11)),
), max_size=60)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, tracked=st.booleans())
def test_compiled_batch_calls_equal_the_defaults(ops, tracked):
    ref, compiled, fallback = PureLRUCachePolicy(8), LRUCachePolicy(8), FallbackLRUCachePolicy(8)
    adapted = AdaptedLRU(8)
    policies = (ref, compiled, fallback, adapted)
    assert compiled.batch_calls and not ref.batch_calls
    for p in policies if tracked else ():
        p.evictable((), False)
    next_id = 0
    for op in ops:
        kind, arg = op[0], op[1]
        answers: list = [None] * 4
        if kind == "insert":
            keys = list(dict.fromkeys(key(i) for i in arg if ref.get(key(i)) is None))
            for p in policies:
                blocks = BlockStatus.many(range(next_id, next_id + len(keys)))
                for b in blocks:
                    b.ref_cnt = op[2]
                p.insert_many(keys[::-1], blocks[::-1])
                if op[2]:
                    p.evictable(keys, False)  # being written, as prepare_store reports it
            next_id += len(keys)
        elif kind == "insert_written":  # as prepare_store stores a request: tail first, tail named
            keys = list(dict.fromkeys(key(i) for i in arg if ref.get(key(i)) is None))
            ids = list(range(next_id, next_id + len(keys)))
            for p in policies:
                table_of(p).insert_written(keys[::-1], ids[::-1], tail=keys[-1] if keys else None)
            next_id += len(keys)
        elif kind == "evict":
            answers = [[(k, b.block_id) for k, b in p.evict(arg, set()) or ()] for p in policies]
        elif kind == "evict_ids":
            protected = {key(i) for i in op[2]}
            answers = [table_of(p).evict_ids(arg, protected) for p in policies]
        elif kind == "remove":
            for p in policies:
                p.remove(key(arg))
        else:
            keys = [key(i) for i in arg]
            if kind == "release_loads":  # (its precondition: every key resident; KeyError otherwise)
                if any(ref.get(k) is None for k in keys):
                    for p in policies:
                        with pytest.raises(KeyError):
                            table_of(p).release_loads(keys)
                    continue
            answers = [getattr(p if kind == "touch" else table_of(p), kind)(keys) for p in policies]
        assert answers[1:] == answers[:1] * 3, (kind, arg)
        assert state(compiled) == state(ref) == state(fallback) == state(adapted), (kind, arg)
    assert type(table_of(adapted)) is PolicyTable and type(table_of(ref)) is type(table_of(fallback)) is PureTable


@pytest.mark.parametrize("cls", [LRUCachePolicy, PureLRUCachePolicy])
def test_the_manager_path_of_a_request(cls):
    """The cycle the manager runs through the batch calls: written, found, pinned for loading
    (out of the eviction order), released, evictable again (oldest first: inserted tail first)."""
    p = cls(4)
    table = table_of(p)
    keys = [key(i) for i in range(3)]
    table.insert_written(keys[::-1], [12, 11, 10], tail=keys[-1])
    with pytest.raises(ValueError, match="3 keys but 2 block ids"):
        table.insert_written([key(5), key(6), key(7)], [1, 2])
    assert table.readable_run(keys) == 0 and table.absent(keys + [key(9)]) == [key(9)]
    assert table.mark_written(keys) and not table.mark_written(keys[:1])  # (only blocks being written)
    assert table.readable_run(keys + [key(9)]) == 3 and table.evictable_count() == 3
    assert table.pin_loads(keys[:2] + [key(9)]) is None and table.evictable_count() == 3  # refused: unchanged
    assert table.pin_loads(keys[:2]) == [10, 11] and table.pinned_keys() == set(keys[:2])
    assert [k for k, _ in p.evict(1, set())] == [keys[2]] and p.evict(1, set()) is None
    table.release_loads(keys[:2])
    assert table.pinned_keys() == set() and [k for k, _ in p.evict(2, set())] == [keys[1], keys[0]]
