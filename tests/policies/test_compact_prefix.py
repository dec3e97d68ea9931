"""`prefix-freq`'s compiled index (kvtier/policies/prefix_compiled.py) against the pure-Python
`PurePrefixFreqCachePolicy`: the same decisions and the same inner state under any operation
sequence (the compiled class and its fallback `FallbackPrefixFreqCachePolicy`), the batch calls
equal to the `CachePolicy` defaults, the one-time-tail rule reached by the generated traffic, and
views of blocks that left raising instead of touching another block.

What is compared after every step (`state`): each resident key's block id and ref_cnt, the
eviction order (`victims`), pins and evictable counts, and the inner
state that decides later evictions: the ghost list in order, the ghost limit, the clock (the
clock at the last sync: the blocks inserted since are added by the next other call), the running
mean `unit` (exact float equality) and the tail evidence (`TailEvidence.counts`)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtier.core.types import BlockStatus
from kvtier.index import table_of
from kvtier.policies.prefix_compiled import FallbackPrefixFreqCachePolicy, PrefixFreqCachePolicy
from kvtier.policies.prefix_pure import PurePrefixFreqCachePolicy
from kvtier.policies.prefix_tails import TailEvidence
from tests.support.policy_state import evictable_count_of, pinned_of

CLASSES = (PurePrefixFreqCachePolicy, PrefixFreqCachePolicy, FallbackPrefixFreqCachePolicy)


def key(i: int) -> bytes:
    """Keys of four lengths (8, 32, 56 and 80 bytes: the last is past the index's inline width,
    a key with an allocation of its own, in the index and in the ghost list)."""
    return i.to_bytes(4, "big") * (1 + i % 4 * 6) + b"\0\0\0\0"


def block(block_id: int, ref_cnt: int) -> BlockStatus:
    b = BlockStatus(block_id)
    b.ref_cnt = ref_cnt
    return b


def tail_counts(p) -> list[int]:
    """The tail evidence (`tail_counts`, a property of every implementation)."""
    return list(p.tail_counts)


def rule_on(p) -> bool:
    """Whether `p` evicts request tails first now, read from its `tail_counts` (the pure rule)."""
    evidence = TailEvidence()
    evidence.counts = tail_counts(p)
    return evidence.one_time(PurePrefixFreqCachePolicy.tail_reuse_max)


def rule_reason(p) -> str:
    """Which part of the tail rule decides now (for the statistics of the generated tests)."""
    te, tr, ne, nr, th, nh = tail_counts(p)
    if te + th < 64 or ne + nh < 64:
        return "tail rule off: too few departures"
    if rule_on(p):
        return "tail rule on"
    cap = th + tr >= PurePrefixFreqCachePolicy.tail_reuse_max * (th + te)
    return "tail rule off by its 10% cap" if cap else "tail rule off by its ratio"


def state(p) -> tuple:
    n = len(p)
    pinned = pinned_of(p)
    return (n, sorted((k, p.get(k).block_id, p.get(k).ref_cnt) for k in p.keys()),
            [(k, p.get(k).block_id, p.get(k).ref_cnt) for k in p.victims(n)],
            [p.victims(m) for m in (-1, 1, n // 2, n + 1)],
            None if pinned is None else sorted(pinned), evictable_count_of(p),
            list(p.ghosts.items()), p.ghost_limit, p.clock, p.unit, tail_counts(p))


class Drive:
    """Runs the same calls on every policy, choosing them from the reference's state (equal to the
    others': `check` after every step), as the manager would: only absent keys are inserted, a
    block's ref_cnt changes are reported through pin/unpin, evictions protect the request's keys."""

    def __init__(self, capacity: int, tracked: bool) -> None:
        self.policies = [cls(capacity) for cls in CLASSES]
        self.ref = self.policies[0]
        for p in self.policies if tracked else ():
            p.evictable((), False)
        self.next_id = 0
        self.fresh = 1000  # fresh keys (request tails among them) from here on
        self.convs: list[list[bytes]] = [[] for _ in range(4)]  # (see conversation_turn)
        self.last_tail: list[bytes | None] = [None] * 4
        self.restart = 0.1  # (see conversation_turn)
        self.pending: list[bytes] = []  # inserted being written (ref_cnt -1), not marked yet
        self.rule_evictions = 0  # evictions that took place with the tail rule on
        self.trims = 0  # evictions that trimmed the ghost list
        self.reasons: set[str] = set()  # what decided the tail rule at the evictions (`rule_reason`)

    def check(self, what: object) -> None:
        expected = state(self.ref)
        for p in self.policies[1:]:
            assert state(p) == expected, (what, type(p).__name__)

    def new_key(self) -> bytes:
        self.fresh += 1
        return key(self.fresh)

    def pick(self, i: int) -> bytes:
        """A resident key, a ghost or a key of the small universe."""
        known = sorted(self.ref.keys()) + list(self.ref.ghosts) + [key(j) for j in range(24)]
        return known[i % len(known)]

    def insert(self, keys: list[bytes], ref_cnt: int, tail: bytes | None = None, single: bool = False) -> None:
        for p in self.policies:
            blocks = [block(self.next_id + j, ref_cnt) for j in range(len(keys))]
            if single:
                p.insert(keys[0], blocks[0])
            else:
                p.insert_many(keys, blocks, tail=tail)
            if ref_cnt:
                p.evictable(keys, False)  # (a no-op while pins are not tracked)
        self.next_id += len(keys)
        if ref_cnt == -1:
            self.pending += keys

    def set_ref(self, k: bytes, value: int) -> None:
        old = self.ref.get(k).ref_cnt
        for p in self.policies:
            p.get(k).ref_cnt = value
            if old == 0 and value != 0:
                p.evictable([k], False)
            elif old != 0 and value == 0:
                p.evictable([k], True)

    def evict(self, n: int, protected: set[bytes]) -> list | None:
        counts = [evictable_count_of(p, protected) for p in self.policies]
        assert counts[1:] == counts[:1] * 2, counts
        on, ghosts = rule_on(self.ref), len(self.ref.ghosts)
        self.reasons.add(rule_reason(self.ref))
        got = [p.evict(n, protected) for p in self.policies]
        answers = [None if v is None else [(k, b.block_id) for k, b in v] for v in got]
        assert answers[1:] == answers[:1] * 2, (n, protected)
        if answers[0] and on:
            self.rule_evictions += 1
        if answers[0] and len(self.ref.ghosts) < ghosts + len(answers[0]):
            self.trims += 1
        return answers[0]

    def finish_writes(self, rng: random.Random) -> None:
        """The writes of earlier requests complete (most of them): ref_cnt 0 and unpinned."""
        still = []
        for k in self.pending:
            b = self.ref.get(k)
            if b is None or b.ref_cnt != -1:
                continue
            if rng.random() < 0.8:
                self.set_ref(k, 0)
            else:
                still.append(k)
        self.pending = still

    def request(self, rng: random.Random, repeat_tails: float) -> None:
        """One engine request (`conversation_turn`): its hits touched, room made and its new
        blocks inserted being written, tail first, with `tail=` their last."""
        ref = self.ref
        self.finish_writes(rng)
        keys = self.conversation_turn(rng, repeat_tails)
        hits = 0
        while hits < len(keys) and (b := ref.get(keys[hits])) is not None and b.ref_cnt >= 0:
            hits += 1
        for p in self.policies:
            p.touch(keys[:hits])
        self.check(("request touch", keys[:hits]))
        new = [k for k in keys[hits:] if ref.get(k) is None]
        need = len(ref) + len(new) - ref.cache_capacity
        if need > 0 and self.evict(need, set(keys)) is None:
            return  # no room: the request is not stored
        if new:
            self.insert(new[::-1], -1, tail=new[-1])
        self.check(("request store", new))

    def conversation_turn(self, rng: random.Random, repeat_tails: float) -> list[bytes]:
        """The keys of a request: a turn of one of 4 conversations, which re-sends its history
        (one or two keys of the universe, then the new blocks of its earlier turns), adds 0-2 new
        blocks and a new tail; with probability `restart` it starts again (its new blocks are not
        reused). The slot's previous tail is re-sent with probability `repeat_tails`: half of the
        time before the new blocks, half of the time as an exact repeat of the previous request
        (whose tail, if evicted, returns as this request's tail). Together they set the reuse rates
        that the tail rule compares."""
        c = rng.randrange(4)
        if len(self.convs[c]) > 6 or not self.convs[c] or rng.random() < self.restart:  # a new conversation
            self.convs[c] = [key(c * 6 + j) for j in range(rng.randint(1, 2))]
        keys = list(self.convs[c])
        if self.last_tail[c] is not None and rng.random() < repeat_tails:
            keys.append(self.last_tail[c])
            if rng.random() < 0.5:
                return keys
        added = [self.new_key() for _ in range(rng.randint(0, 2))]
        self.convs[c] += added
        self.last_tail[c] = self.new_key()
        return keys + added + [self.last_tail[c]]

    def requests(self, seed: int, count: int, repeat_tails: float, restart: float = 0.1) -> None:
        rng = random.Random(seed)
        self.restart = restart
        for _ in range(count):
            self.request(rng, repeat_tails)


IDX = st.integers(0, 63)
# Request traffic (`Drive.requests`): tails reused by about 0-25% of their departures and new
# blocks by about 10-70%, so that the tail rule's cap (10%) and its ratio (half of the new blocks'
# rate) each decide in some examples.
REPEATS = st.sampled_from([0.0, 0.03, 0.1, 0.15, 0.2, 0.3])
RESTARTS = st.sampled_from([0.1, 0.5, 0.9])
OPS = st.lists(st.one_of(
    st.tuples(st.just("insert_many"), st.lists(IDX, max_size=5), st.integers(0, 2), st.sampled_from([-1, 0, 0, 2]),
              st.sampled_from(["none", "first", "first", "other", "ghost"])),
    st.tuples(st.just("insert"), IDX, st.sampled_from([-1, 0, 0])),
    st.tuples(st.just("touch"), st.lists(IDX, max_size=6)),
    st.tuples(st.just("evict"), st.integers(0, 14), st.lists(IDX, max_size=4)),
    st.tuples(st.just("remove"), IDX),
    st.tuples(st.just("ref"), IDX, st.sampled_from([-1, 0, 0, 1, 2])),
    st.tuples(st.just("report"), IDX),
    st.tuples(st.just("ghost_limit"), st.integers(0, 4)),
    st.tuples(st.just("requests"), st.integers(0, 2**16), st.integers(1, 30), REPEATS, RESTARTS),
    st.tuples(st.just("first_notice")),
    st.tuples(st.just("clear")),
), max_size=40)


def run_op(d: Drive, op: tuple) -> None:
    kind, ref = op[0], d.ref
    if kind == "insert_many":
        keys = list(dict.fromkeys(k for k in map(d.pick, op[1]) if ref.get(k) is None))
        keys += [d.new_key() for _ in range(op[2])]
        tail = None
        if keys and op[4] != "none":
            tail = {"first": keys[0], "other": keys[-1],
                    "ghost": next((k for k in keys if k in ref.ghosts), keys[0])}[op[4]]
        d.insert(keys, op[3], tail=tail)
    elif kind == "insert":
        k = d.pick(op[1])
        if ref.get(k) is None:
            d.insert([k], op[2], single=True)
    elif kind == "touch":
        keys = [d.pick(i) for i in op[1]]
        for p in d.policies:
            p.touch(keys)
    elif kind == "evict":
        d.evict(op[1], {d.pick(i) for i in op[2]})
    elif kind == "remove":
        k = d.pick(op[1])
        for p in d.policies:
            p.remove(k)
    elif kind == "ref" and len(ref):
        d.set_ref(sorted(ref.keys())[op[1] % len(ref)], op[2])
    elif kind == "report" and len(ref):  # a redundant report, true to the block's ref_cnt
        k = sorted(ref.keys())[op[1] % len(ref)]
        pinned = ref.get(k).ref_cnt != 0
        for p in d.policies:
            p.evictable([k, k], not pinned)
    elif kind == "ghost_limit":
        for p in d.policies:
            p.ghost_limit = op[1]
    elif kind == "requests":
        d.requests(op[1], op[2], op[3], op[4])
    elif kind == "first_notice":
        for p in d.policies:
            p.evictable((), False)
    elif kind == "clear":
        d.pending.clear()
        for p in d.policies:
            p.clear()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=OPS, capacity=st.integers(6, 12), tracked=st.booleans(), warm=st.sampled_from([0, 70, 110, 150]),
       seed=st.integers(0, 2**16), repeat=st.sampled_from([0.03, 0.1, 0.2]), restart=st.sampled_from([0.1, 0.9]))
def test_same_decisions_as_prefix_freq(ops, capacity, tracked, warm, seed, repeat, restart):
    """`PurePrefixFreqCachePolicy`, the compiled `prefix-freq` and its fallback, driven alike: identical
    evictions (keys in order, block ids, refusals) and inner state after every step. `warm`
    requests of one-time tails first (the tail rule switches on in most of those examples; more
    request bursts come among the ops). Tails: first as the manager passes them, not first, and
    returning ghosts; ghost limits lowered so that the ghost list is trimmed."""
    d = Drive(capacity, tracked)
    d.check("new")
    if warm:
        d.requests(seed, warm, repeat, restart)
    for op in ops:
        run_op(d, op)
        d.check(op)
    if d.trims:
        event("ghost list trimmed")
    for reason in d.reasons:
        event(f"evictions with {reason}")


# ---------------------------------------------------------------------- the batch calls
BATCH = st.lists(IDX, max_size=6)
BATCH_OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(IDX, max_size=4), st.sampled_from([-1, 0])),
    st.tuples(st.just("insert_written"), st.lists(IDX, max_size=4), st.integers(0, 2),
              st.sampled_from(["none", "first", "other", "ghost"])),
    st.tuples(st.sampled_from(["readable_run", "absent", "pin_loads", "release_loads", "mark_written"]), BATCH),
    st.tuples(st.just("evict"), st.integers(1, 3)),
    st.tuples(st.just("evict_ids"), st.integers(0, 4), st.lists(IDX, max_size=3)),
    st.tuples(st.just("touch"), BATCH),
    st.tuples(st.just("remove"), IDX),
    st.tuples(st.just("ghost_limit"), st.integers(0, 3)),
    st.tuples(st.just("requests"), st.integers(0, 2**16), st.integers(1, 30), REPEATS, RESTARTS),
    st.tuples(st.just("loads"), BATCH),
    st.tuples(st.just("release"), st.integers(1, 6)),
), max_size=40)


TABLE_CALLS = {"readable_run", "absent", "insert_written", "pin_loads", "release_loads", "mark_written", "evict_ids"}


class BatchDrive(Drive):
    """`Drive` through the block table: the reference runs the pure `PureTable` (key by key
    through its blocks, its pins and the pure order's notices); every answer is compared."""

    def __init__(self, capacity: int, tracked: bool) -> None:
        super().__init__(capacity, tracked)
        self.loaded: list[bytes] = []  # pinned by the op "loads", not released yet

    def same(self, call: str, *args, **kwargs):
        if call == "evict_ids":
            self.reasons.add(rule_reason(self.ref))
        answers = [getattr(table_of(p) if call in TABLE_CALLS else p, call)(*args, **kwargs) for p in self.policies]
        assert answers[1:] == answers[:1] * 2, (call, args)
        return answers[0]

    def request(self, rng: random.Random, repeat_tails: float) -> None:
        """The manager's request cycle: finish earlier writes (`mark_written`), find the readable run,
        pin it for loading (`pin_loads`), touch it, store the absent rest (`evict_ids` for room,
        `insert_written` tail first), release the loads."""
        ref = self.ref
        # (once each: a key removed while pending, then inserted again, is pending twice)
        written = list(dict.fromkeys(k for k in self.pending if (b := ref.get(k)) is not None and b.ref_cnt == -1))
        self.pending = []
        if written and rng.random() < 0.8:
            assert self.same("mark_written", written)
        else:
            self.pending = written
        keys = self.conversation_turn(rng, repeat_tails)
        run = self.same("readable_run", keys)
        loaded = keys[:run] if rng.random() < 0.5 else []
        assert self.same("pin_loads", loaded) == [ref.get(k).block_id for k in loaded]
        self.same("touch", keys[:run])
        self.check(("request touch", keys[:run]))
        new = self.same("absent", keys[run:])
        need = len(ref) + len(new) - ref.cache_capacity
        if need <= 0 or self.same("evict_ids", need, set(keys)) is not None:
            ids = list(range(self.next_id, self.next_id + len(new)))
            self.next_id += len(new)
            self.same("insert_written", new[::-1], ids[::-1], tail=new[-1] if new else None)
            self.pending += new
        self.same("release_loads", loaded)
        self.check(("request", keys))


def run_batch_op(d: BatchDrive, op: tuple) -> None:
    kind, ref = op[0], d.ref
    if kind == "insert_written":
        keys = list(dict.fromkeys(k for k in map(d.pick, op[1]) if ref.get(k) is None))
        keys += [d.new_key() for _ in range(op[2])]
        tail = None
        if keys and op[3] != "none":
            tail = {"first": keys[0], "other": keys[-1],
                    "ghost": next((k for k in keys if k in ref.ghosts), keys[0])}[op[3]]
        d.same("insert_written", keys, list(range(d.next_id, d.next_id + len(keys))), tail=tail)
        d.next_id += len(keys)
    elif kind == "insert":
        keys = list(dict.fromkeys(k for k in map(d.pick, op[1]) if ref.get(k) is None))
        d.insert(keys[::-1], op[2], tail=keys[-1] if keys else None)
    elif kind == "evict":
        d.evict(op[1], set())
    elif kind == "evict_ids":
        d.same("evict_ids", op[1], {d.pick(i) for i in op[2]})
    elif kind == "remove":
        d.same("remove", d.pick(op[1]))
    elif kind == "ghost_limit":
        for p in d.policies:
            p.ghost_limit = op[1]
    elif kind == "requests":
        d.requests(op[1], op[2], op[3], op[4])
    elif kind == "loads":  # resident keys, repeated at times (a key given twice: ref_cnt 2)
        resident = sorted(ref.keys())
        keys = [resident[i % len(resident)] for i in op[1]] if resident else []
        if d.same("pin_loads", keys) is not None:
            d.loaded += keys
    elif kind == "release":  # what "loads" pinned, in the order pinned
        keys, d.loaded = d.loaded[:op[1]], d.loaded[op[1]:]
        release(d, keys)
    elif kind == "release_loads":  # any keys: blocks not loaded go below 0 (as the defaults do)
        release(d, [d.pick(i) for i in op[1]])
    else:
        d.same(kind, [d.pick(i) for i in op[1]])


def release(d: BatchDrive, keys: list[bytes]) -> None:
    if any(d.ref.get(k) is None for k in keys):
        for p in d.policies:  # (its precondition: every key resident; KeyError, nothing changed)
            with pytest.raises(KeyError):
                table_of(p).release_loads(keys)
    else:
        d.same("release_loads", keys)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=BATCH_OPS, capacity=st.integers(6, 12), tracked=st.booleans(), warm=st.sampled_from([0, 110]),
       seed=st.integers(0, 2**16), repeat=st.sampled_from([0.03, 0.1, 0.2]), restart=st.sampled_from([0.1, 0.9]))
def test_compiled_batch_calls_equal_the_defaults(ops, capacity, tracked, warm, seed, repeat, restart):
    """Batches repeat keys and mix resident, absent, ghost, pinned and unwritten blocks, with and
    without evictable accounting, so refusals (nothing changed) come as often as the common case.
    `warm` requests through the batch calls first (the tail rule switches on in most of those)."""
    d = BatchDrive(capacity, tracked)
    assert d.policies[1].batch_calls is d.policies[1].compiled and not d.ref.batch_calls
    if warm:
        d.requests(seed, warm, repeat, restart)
    for op in ops:
        run_batch_op(d, op)
        d.check(op)
    for reason in d.reasons:
        event(f"evictions with {reason}")


@pytest.mark.parametrize("cls", CLASSES)
def test_insert_written_refuses_ids_that_do_not_match_the_keys(cls):
    p = cls(4)
    table = table_of(p)
    table.insert_written([key(1)], [5], tail=key(1))
    with pytest.raises(ValueError, match="3 keys but 2 block ids"):
        table.insert_written([key(2), key(3), key(4)], [1, 2], tail=key(2))
    assert list(p.keys()) == [key(1)] and table.absent([key(2), key(3), key(4)]) == [key(2), key(3), key(4)]


# ---------------------------------------------------------------------- the tail rule is reached
@pytest.mark.parametrize("tracked", [False, True])
def test_the_generated_traffic_switches_the_tail_rule_on_and_all_evict_tails_first(tracked):
    """The requests of the tests above (one-time tails) prove tails one-time after 64 tail and 64
    new-block departures; from then on every implementation evicts request tails first, and an
    older request's ordinary new block after a newer request's tail (before: the other way)."""

    def two_requests() -> tuple[bytes, bytes, bytes]:
        old, tail1, tail2 = d.new_key(), d.new_key(), d.new_key()
        d.insert([tail1, old], 0, tail=tail1)
        for p in d.policies:
            p.touch([])  # (the next request's blocks get a later stamp)
        d.insert([tail2, d.new_key()], 0, tail=tail2)
        d.check("two requests")
        return old, tail1, tail2

    d = Drive(12, tracked)
    rng = random.Random(7)
    old, _, tail2 = two_requests()
    order = d.ref.victims(len(d.ref))
    assert order.index(old) < order.index(tail2)  # rule off: recency (an older ordinary block first)
    for p in d.policies:
        p.clear()
    switched = None
    for r in range(400):
        d.request(rng, 0.03)
        if switched is None and rule_on(d.ref):
            switched = r
    assert switched is not None and switched >= 63 and d.rule_evictions > 0
    assert all(rule_on(p) for p in d.policies)  # (what it means for the victim order: checked below)
    for k in list(d.pending):
        if (b := d.ref.get(k)) is not None and b.ref_cnt == -1:
            d.set_ref(k, 0)
    d.pending.clear()
    old, tail1, tail2 = two_requests()
    aside = [k for k, (segment, *_) in d.ref.aside.items() if segment == 0]  # (met by evictions)
    tails = {k for k in [*d.ref.segs[0], *aside] if d.ref.get(k).ref_cnt == 0}
    order = d.ref.victims(len(d.ref))
    assert set(order[:len(tails)]) == tails and tail1 in tails and tail2 in tails
    assert order.index(tail2) < order.index(old)
    victims = d.evict(len(tails), set())
    assert {k for k, _ in victims} == tails
    d.check("tails evicted")


# ---------------------------------------------------------------------- views
@pytest.mark.skipif(not PrefixFreqCachePolicy.compiled, reason="views exist only in the compiled index")
def test_a_view_of_a_block_that_left_raises_instead_of_touching_another():
    """Views from `get` of blocks that were removed, evicted or cleared
    raise LookupError on reading or writing ref_cnt, also once their key (or another) is stored
    again in the freed place; the blocks resident then are unchanged."""
    p = PrefixFreqCachePolicy(4)
    assert p.returns_views and p.batch_calls
    p.insert_many([key(1), key(2), key(3)], [block(7, 0), block(8, 0), block(9, 0)], tail=key(1))
    removed, evicted = p.get(key(1)), p.get(key(2))
    candidate = p.get(key(3))
    p.remove(key(1))
    assert sorted(k for k, _ in p.evict(2, set())) == [key(2), key(3)]
    p.insert(key(1), block(10, 0))  # the same key again, likely in the same place
    p.insert_many([key(4), key(5)], [block(11, 0), block(12, 0)])
    for view in (removed, evicted, candidate):
        with pytest.raises(LookupError):
            view.ref_cnt = 3
        with pytest.raises(LookupError):
            _ = view.ref_cnt
    assert [(k, p.get(k).block_id, p.get(k).ref_cnt) for k in (key(1), key(4), key(5))] == [
        (key(1), 10, 0), (key(4), 11, 0), (key(5), 12, 0)]
    live = p.get(key(4))
    p.clear()
    p.insert(key(4), block(13, 0))
    with pytest.raises(LookupError):
        live.ref_cnt = 1
    assert p.get(key(4)).ref_cnt == 0 and p.get(key(4)).block_id == 13
