# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled order of `prefix-freq` (kvtier.policies.prefix_compiled): `PrefixOrder`, its
decisions as an eviction order composed into a compiled block table (`CompactTable`).

The design and every rule are `PrefixFreqCachePolicy`'s (kvtier/policies/prefix_pure.py); these
modules keep the same state in another layout and make exactly the same decisions (checked against
it by tests/policies/test_compact_prefix.py):

- the table holds each resident block's 24-byte entry (block id, key hash, ref_cnt, key length,
  flags, and the block's segment in the byte the table leaves to the order), its key (inline up
  to 64 bytes) and its hash-table buckets, and grows them with the order's 24-byte record per
  entry (segment links, stamp, aside sequence number): 48 bytes of records per block, about 92
  bytes with vLLM's 36-byte keys;
- the segments, aside queues and the eviction walk are kvtier/policies/_compact_prefix_order.pyx;
- the ghost list (`GhostList`: evicted keys, oldest first) is in C arrays too, with a hash table of
  its own (kvtier/policies/_compact_prefix_ghosts.pyx);
- this module: the order class (clock, credits, tail evidence, inserts, touches, evictions).

Floats: the clock, stamps, the running mean `unit` and the scores are C doubles computed with the
same operations in the same order as the Python floats of the pure class (setup.py builds without
floating-point contraction), so the two agree to the last bit.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t

from kvtier.index._table cimport USED, key_at, key_in, locate_in
from kvtier.index._table_api cimport CompactOrder
from kvtier.policies._compact_prefix_ghosts cimport (
    Ghosts, ghost_add, ghost_clear, ghost_dict, ghost_free, ghost_pop, ghost_trim,
)
from kvtier.policies._compact_prefix_order cimport (
    ASIDE, MAX_SEGS, TAIL, Core, IdxVec, Rec, leave, order_bytes, order_clear, order_free, place, push_freed, rec,
    set_aside, unlink, walk,
)

from kvtier.policies.prefix_tails import TailEvidence

# Indexes of `tail_counts` (kvtier/policies/prefix_tails.py).
cdef enum:
    EVICTED_TAIL = 0
    RETURNED_TAIL = 1
    EVICTED_NEW = 2
    RETURNED_NEW = 3
    HIT_TAIL = 4
    HIT_NEW = 5


cdef class PrefixOrder(CompactOrder):
    """`PurePrefixFreqCachePolicy`'s decisions as an eviction order composed into a compiled block
    table (see the module docstring); `kvtier.policies.prefix_compiled.PrefixFreqCachePolicy`
    makes the pair. `tuning` is an object with the attributes `credits`, `tail_reuse_max`,
    `ghost_fraction`, `max_ghost_limit`, `unit_rate` and `demote_tail` (the policy class), read
    when the order is made; the capacity is the table's."""

    cdef Core c
    cdef double now  # the logical clock (an integer held in a double)
    cdef double mean_age  # `unit`: clock ticks per credit
    cdef Py_ssize_t mark  # the count when the clock was last synced
    cdef double rate, reuse_max
    cdef double credit[MAX_SEGS]
    cdef bint demote
    cdef int64_t counts[6]
    cdef Ghosts gh  # the ghost list: evicted keys and their segment then, oldest first
    cdef Py_ssize_t glimit
    cdef Py_ssize_t capacity  # as given (the arrays may grow past it)
    cdef IdxVec met  # the entries an eviction's walk passed over (its scratch, kept between evictions)

    cdef double ghost_fraction
    cdef Py_ssize_t max_ghosts

    def __cinit__(self, tuning, *args, **kwargs):
        cdef int s
        self.rec_size = sizeof(Rec)
        self.label = "prefix-freq"
        order_clear(&self.c)
        credits = tuple(tuning.credits)
        if not 1 <= len(credits) < MAX_SEGS:
            raise ValueError(f"prefix-freq: credits must hold 1 to {MAX_SEGS - 1} values, got {len(credits)}")
        self.c.nsegs = len(credits) + 1
        for s in range(len(credits)):
            self.credit[s] = credits[s]
        self.rate, self.reuse_max, self.demote = tuning.unit_rate, tuning.tail_reuse_max, tuning.demote_tail
        self.tails = self.demote
        self.ghost_fraction, self.max_ghosts = tuning.ghost_fraction, tuning.max_ghost_limit

    cdef int attached(self) except -1:
        cap = self.capacity = self.t.want
        self.c.t = self.t
        self.glimit = min(int(cap * self.ghost_fraction), self.max_ghosts)
        self.mean_age = float(cap)
        return 0

    def __dealloc__(self):
        order_free(&self.c)
        ghost_free(&self.gh)
        PyMem_Free(self.met.v)

    cdef double sync(self):
        """Advance the clock by the blocks inserted since it was last synced; returns it."""
        self.now += self.c.t.count - self.mark
        self.mark = self.c.t.count
        return self.now

    # ------------------------------------------------------------------ inspection
    @property
    def ghosts(self):
        """Evicted key -> its segment then, oldest first (a new dict: inspection, O(ghosts))."""
        return ghost_dict(&self.gh)

    @property
    def ghost_limit(self):
        """Ghosts kept: between 1x and 2x this many keys."""
        return self.glimit

    @ghost_limit.setter
    def ghost_limit(self, Py_ssize_t limit):
        self.glimit = limit

    @property
    def clock(self):
        return self.now

    @property
    def unit(self):
        return self.mean_age

    @property
    def tail_counts(self):
        """The departures of tails and new blocks (`TailEvidence.counts`, a copy); settable, as
        evidence carried over from another instance."""
        return [self.counts[k] for k in range(6)]

    @tail_counts.setter
    def tail_counts(self, counts):
        cdef int k
        values = [int(v) for v in counts]
        if len(values) != 6 or min(values) < 0:
            raise ValueError(f"prefix-freq: tail_counts must be 6 counts >= 0, got {counts!r}")
        for k in range(6):
            self.counts[k] = values[k]

    @property
    def aside(self):
        """The keys set aside now (pinned or protected when an eviction met them): inspection, O(n)."""
        cdef int32_t i
        if self.t == NULL:
            return []
        return [key_in(self.c.t, i) for i in range(self.c.t.hw)
                if self.c.t.e[i].flags & USED and self.c.t.e[i].flags & ASIDE]

    def memory_bytes(self):
        """Bytes allocated for the order's own arrays now (the queues; its records are the
        table's); not the ghosts."""
        return order_bytes(&self.c)

    # ------------------------------------------------------------------ the table's notices
    cdef int destination(self, int32_t i, bint tail) except -1:
        """The segment of entry i, just inserted (`PrefixFreqCachePolicy._place`): a returning
        ghost by its history (the re-store counts as a hit), else the tails or the new blocks."""
        cdef int ghost = ghost_pop(&self.gh, key_at(self.c.t, i), self.c.t.e[i].klen, self.c.t.e[i].hash)
        if ghost < 0:
            return TAIL if tail and self.demote else 1
        if ghost <= 1:
            self.counts[RETURNED_TAIL if ghost == TAIL else RETURNED_NEW] += 1
        return min(max(ghost, 1) + 1, self.c.nsegs - 1)

    cdef int entered(self, int32_t i, bint tail) except -1:
        """A new entry goes into its segment. The clock is not advanced: `sync` counts the
        inserts at the next call that reads it."""
        place(&self.c, i, self.destination(i, tail), self.now)
        return 0

    cdef int unpinned(self, int32_t i) except -1:
        """An aside entry that became evictable is queued (duplicates are dropped when the queue
        is read)."""
        if self.c.t.e[i].flags & ASIDE:
            push_freed(&self.c, i)
        return 0

    cdef int leaving(self, int32_t i) except -1:
        """Entry i is removed: the clock is synced first, and the count it is synced to drops with it."""
        self.sync()
        leave(&self.c, i)
        self.mark -= 1
        return 0

    cdef int touched(self, list keys) except -1:
        cdef Core* c = &self.c
        cdef double now = self.sync(), unit = self.mean_age, rate = self.rate, stamp
        cdef int32_t i
        cdef int s, top = c.nsegs - 1
        for key in reversed(keys):
            i = locate_in(c.t, key)
            if i < 0:
                continue
            s = c.t.e[i].spare
            if c.t.e[i].flags & ASIDE:
                c.t.e[i].flags &= ~ASIDE  # touched: back in the order, in the segment it moves to
            else:
                unlink(c, i)
            stamp = rec(c, i).stamp
            now += 1.0
            unit += (now - stamp - unit) * rate
            if s <= 1:
                self.counts[HIT_TAIL if s == TAIL else HIT_NEW] += 1
            place(c, i, 2 if s == TAIL else min(s + 1, top), now)
        self.now, self.mean_age = now, unit
        return 0

    cdef int cleared(self) except -1:
        cdef int s
        order_clear(&self.c)
        ghost_clear(&self.gh)
        for s in range(6):
            self.counts[s] = 0
        self.now, self.mark, self.mean_age = 0.0, 0, float(self.capacity)
        return 0

    # ------------------------------------------------------------------ decisions (`walk`)
    cdef bint tails_one_time(self) except -1:
        """`TailEvidence.one_time(tail_reuse_max)`. Python compares its integer products with
        floats exactly: here they are int64 (exact while every count is below 2**30) compared in
        long double (which holds both without rounding); beyond that, the Python rule itself."""
        cdef int64_t te = self.counts[EVICTED_TAIL], tr = self.counts[RETURNED_TAIL]
        cdef int64_t ne = self.counts[EVICTED_NEW], nr = self.counts[RETURNED_NEW]
        cdef int64_t th = self.counts[HIT_TAIL], nh = self.counts[HIT_NEW]
        cdef int64_t reused = th + tr, left = th + te
        if te + th < 64 or ne + nh < 64:
            return False
        if max(te, tr, ne, nr, th, nh) >= (<int64_t>1 << 30):
            evidence = TailEvidence()
            evidence.counts = self.tail_counts
            return evidence.one_time(self.reuse_max)
        return (<long double>(reused * (nh + ne)) < <long double>(0.5 * <double>(nh + nr) * <double>left)
                and <long double>reused < <long double>(self.reuse_max * <double>left))

    cdef void offsets(self, double* out) noexcept:
        cdef int s
        out[TAIL] = 0.0
        for s in range(1, self.c.nsegs):
            out[s] = self.credit[s - 1] * self.mean_age

    cdef Py_ssize_t find_victims(self, Py_ssize_t n, int32_t* out, bint exact, IdxVec* met) except -1:
        """`walk` (the protected entries carry MARK): up to n victims in order (with `exact`, n or 0)."""
        cdef double offs[MAX_SEGS]
        cdef Py_ssize_t got
        self.offsets(offs)
        got = walk(&self.c, n, out, self.tails_one_time(), offs, met)
        return got if got == n or not exact else 0

    cdef Py_ssize_t pick(self, Py_ssize_t n, int32_t* chosen) except -1:
        """`evict`'s victims (`walk`); with pins tracked, the entries it passed over are kept in
        `met`, set aside when the victims leave."""
        self.met.n = 0
        return self.find_victims(n, chosen, True, &self.met if self.c.t.tracking else NULL)

    cdef int forget(self, int32_t* chosen, Py_ssize_t n) except -1:
        """The victims' ghosts in `_forget`'s order (by segment, the one-time tails last) and
        their departures counted."""
        cdef Core* c = &self.c
        cdef Py_ssize_t j
        cdef int32_t i
        cdef int s, k, first = 1 if self.tails_one_time() else 0
        for k in range(first, c.nsegs + first):
            s = k % c.nsegs
            for j in range(n):
                i = chosen[j]
                if c.t.e[i].spare == s:
                    ghost_add(&self.gh, key_at(c.t, i), c.t.e[i].klen, c.t.e[i].hash, s)
                    if s <= 1:
                        self.counts[EVICTED_TAIL if s == TAIL else EVICTED_NEW] += 1
        return 0

    cdef int evicting(self, int32_t* chosen, Py_ssize_t n) except -1:
        """The victims leave the order (their ghosts first); the table releases them next."""
        cdef Py_ssize_t j
        self.sync()
        self.forget(chosen, n)
        for j in range(n):
            leave(&self.c, chosen[j])
        return 0

    cdef int evicted(self) except -1:
        """The victims were released: the entries `pick` passed over are set aside."""
        cdef Core* c = &self.c
        cdef Py_ssize_t j
        cdef int32_t i
        self.mark = c.t.count
        for j in range(self.met.n):
            i = self.met.v[j]
            if c.t.e[i].flags & USED and not c.t.e[i].flags & ASIDE:
                set_aside(c, i)
        self.met.n = 0
        ghost_trim(&self.gh, self.glimit)
        return 0

    def victims(self, Py_ssize_t n, skip=()):
        """The keys `evict(n, skip)` would take now, in its order, in one C walk; not counting
        `skip` keys (the order does not depend on them)."""
        cdef int32_t* out
        cdef Py_ssize_t got, j
        if self.t == NULL:
            raise RuntimeError("prefix-freq: this order is not part of a table")
        if skip:
            return [k for k in self.victims(n + len(skip)) if k not in skip][:n]
        n = min(n, self.c.t.count)
        if n <= 0:
            return []
        out = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        if out == NULL:
            raise MemoryError()
        try:
            got = self.find_victims(n, out, False, NULL)
            return [key_in(self.c.t, out[j]) for j in range(got)]
        finally:
            PyMem_Free(out)
