# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled core of `prefix-freq` (kvtier.policies.compact_prefix): its decisions over C arrays.

The design and every rule are `PrefixFreqCachePolicy`'s (kvtier/policies/prefix_pure.py); this module
keeps the same state in another layout and makes exactly the same decisions (checked against it
by tests/policies/test_compact_prefix.py):

- an entry per resident block, a 48-byte record (block id, key hash, stamp, aside sequence number,
  segment links, ref_cnt, key length, flags, segment) in one array, the key inline in a second
  (up to 64 bytes; a longer one has an allocation of its own) and the arrays growing as blocks
  arrive (_compact_table.pxi, shared with `lru`), two int32 slots of an open-addressing hash table;
- a segment is a doubly-linked list of entries (stamps increase along it);
- an *aside* entry (pinned or protected when an eviction's walk met it) is out of its list; the
  unpinned ones are queued per segment as (stamp, sequence number, entry) and read, sorted, before
  the list (`AsideBlocks`' rule, kvtier/policies/prefix_aside.py);
- the ghost list (`GhostList`: evicted keys, oldest first) is in C arrays too, with a hash table of
  its own (_compact_ghosts.pxi).

Floats: the clock, stamps, the running mean `unit` and the scores are C doubles computed with the
same operations in the same order as the Python floats of the pure class (setup.py builds without
floating-point contraction), so the two agree to the last bit.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject_Hash
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport qsort
from libc.string cimport memcmp, memcpy, memmove, memset

from kvtier.policies.prefix_tails import TailEvidence


cdef enum:
    USED = 1
    PINNED = 2  # reported by `pin` (evictable accounting)
    ASIDE = 4  # out of its segment's list (see the module docstring)
    MARK = 8  # in `protected` during one walk
    MAX_KEY = 65535
    MAX_ENTRIES = 1 << 30
    MAX_SEGS = 16
    TAIL = 0  # segment of request tails; segment 1 + c holds the blocks with c hits

# Indexes of `tail_counts` (kvtier/policies/prefix_tails.py).
cdef enum:
    EVICTED_TAIL = 0
    RETURNED_TAIL = 1
    EVICTED_NEW = 2
    RETURNED_NEW = 3
    HIT_TAIL = 4
    HIT_NEW = 5

POLICY_NAME = "prefix-freq"
cdef double INF = float("inf")

ctypedef struct Entry:
    int64_t block_id
    Py_hash_t hash
    double stamp  # the clock at its last use
    int64_t seq  # while aside: when it was set aside
    int32_t prev  # its segment's list
    int32_t next  # ...and the free list
    int32_t ref_cnt
    uint16_t klen
    uint8_t flags
    uint8_t seg

ctypedef struct Chain:
    int32_t head
    int32_t tail

ctypedef struct Freed:  # an aside entry queued when it became evictable
    double stamp
    int64_t seq
    int32_t idx

ctypedef struct FreedList:
    Freed* items
    Py_ssize_t n
    Py_ssize_t cap
    bint pushed  # items were appended since the list was last sorted

ctypedef struct Core:
    Entry* e
    char* keys
    Py_ssize_t width
    int32_t cap  # entries allocated
    int32_t want  # cache_capacity: the arrays grow to it, doubling, as blocks are inserted
    Py_ssize_t long_bytes  # bytes of the keys longer than INLINE_KEY (allocated one by one)
    int32_t hw  # entries ever used (the rest of the array is untouched)
    int32_t free  # free list head
    int32_t* table
    size_t mask
    Py_ssize_t count
    Py_ssize_t npinned
    int nsegs
    int64_t seq
    Chain seg[MAX_SEGS]
    FreedList freed[MAX_SEGS]

ctypedef struct Lane:  # one segment during a walk (`PrefixFreqCachePolicy._heads`)
    double score  # its head's stamp + offset
    double offset  # credit * unit (tails: 0)
    int32_t head  # its first evictable, unmarked entry
    int32_t cur  # the next list entry to read (-1: none)
    Py_ssize_t fpos  # the next freed item to read
    int seg

ctypedef struct IdxVec:  # a growable array of entries
    int32_t* v
    Py_ssize_t n
    Py_ssize_t cap


include "_compact_table.pxi"


# ---------------------------------------------------------------------- segments, aside, freed
cdef inline void unlink(Core* c, int32_t i) noexcept nogil:
    cdef Chain* l = &c.seg[c.e[i].seg]
    cdef int32_t p = c.e[i].prev, n = c.e[i].next
    if p >= 0:
        c.e[p].next = n
    else:
        l.head = n
    if n >= 0:
        c.e[n].prev = p
    else:
        l.tail = p


cdef inline void place(Core* c, int32_t i, int seg, double stamp) noexcept nogil:
    """Entry i at the end of segment `seg`'s list with this stamp."""
    c.e[i].seg = <uint8_t>seg
    c.e[i].stamp = stamp
    link_tail(c, &c.seg[seg], i)


cdef int push_freed(Core* c, int32_t i) except -1:
    cdef FreedList* f = &c.freed[c.e[i].seg]
    reserve(<void**>&f.items, f.n, &f.cap, sizeof(Freed))
    f.items[f.n] = Freed(c.e[i].stamp, c.e[i].seq, i)
    f.n += 1
    f.pushed = True
    return 0


cdef int set_aside(Core* c, int32_t i) except -1:
    """Take entry i (met pinned or protected by an eviction) out of its list; queued at once
    when it is evictable (protected this time)."""
    unlink(c, i)
    c.e[i].flags |= ASIDE
    c.e[i].seq = c.seq
    c.seq += 1
    if not c.e[i].flags & PINNED:
        push_freed(c, i)
    return 0


cdef int unpin_entry(Core* c, int32_t i) except -1:
    """Entry i became evictable (`unpin`): no longer counted as pinned; an aside entry is queued
    (duplicates are dropped when the queue is read)."""
    forget_pin(c, i)
    if c.e[i].flags & ASIDE:
        push_freed(c, i)
    return 0


cdef void drop(Core* c, int32_t i) noexcept nogil:
    """Forget entry i (remove, evict); its queued items go stale."""
    if not c.e[i].flags & ASIDE:
        unlink(c, i)
    release(c, i)


cdef int freed_order(const void* a, const void* b) noexcept nogil:
    cdef const Freed* x = <const Freed*>a
    cdef const Freed* y = <const Freed*>b
    if x.stamp != y.stamp:
        return -1 if x.stamp < y.stamp else 1
    if x.seq != y.seq:
        return -1 if x.seq < y.seq else 1
    return 0


cdef void settle_freed(Core* c, int s) noexcept nogil:
    """Segment s's queue sorted by (stamp, seq), without stale items (the entry left, came back
    into its list, or was set aside again) or duplicates. Pinned ones stay (read past). Only
    pushes unsort it or add duplicates: without any since the last call, filtering is all."""
    cdef FreedList* f = &c.freed[s]
    cdef Py_ssize_t j, k = 0
    cdef Freed it
    cdef Entry* e
    for j in range(f.n):
        it = f.items[j]
        e = &c.e[it.idx]
        if e.flags & USED and e.flags & ASIDE and e.seg == s and e.seq == it.seq:
            f.items[k] = it
            k += 1
    f.n = k
    if k > 1 and f.pushed:
        qsort(f.items, k, sizeof(Freed), freed_order)
        k = 1
        for j in range(1, f.n):
            if f.items[j].seq != f.items[k - 1].seq:
                f.items[k] = f.items[j]
                k += 1
        f.n = k
    f.pushed = False


cdef inline int32_t lane_next(Core* c, Lane* l) noexcept nogil:
    """The next entry of a lane: its segment's unpinned queued entries, then its list; -1 at the end."""
    cdef FreedList* f = &c.freed[l.seg]
    cdef int32_t i
    while l.fpos < f.n:
        i = f.items[l.fpos].idx
        l.fpos += 1
        if not c.e[i].flags & PINNED:
            return i
    i = l.cur
    if i >= 0:
        l.cur = c.e[i].next
    return i


cdef int vec_push(IdxVec* v, int32_t i) except -1:
    reserve(<void**>&v.v, v.n, &v.cap, sizeof(int32_t))
    v.v[v.n] = i
    v.n += 1
    return 0


cdef inline bint takeable(Core* c, int32_t i) noexcept nogil:
    return c.e[i].ref_cnt == 0 and not c.e[i].flags & MARK


cdef enum:  # how a run ended
    DONE = 0  # n entries taken
    HEAD = 1  # stopped at an entry at or above its bound: the lane's new head
    EMPTY = 2  # the lane ran out


cdef int run(Core* c, Lane* l, double below, int32_t* out, Py_ssize_t* got, Py_ssize_t n,
             IdxVec* met) except -1:
    """Take lane l's evictable, unmarked entries into `out` while their stamps stay below
    `below`, until `n` are there; the entries passed over go to `met` (when not NULL)."""
    cdef int32_t i = lane_next(c, l)
    while i >= 0:
        if takeable(c, i):
            if c.e[i].stamp >= below:
                l.head, l.score = i, c.e[i].stamp + l.offset
                return HEAD
            out[got[0]] = i
            got[0] += 1
            if got[0] == n:
                return DONE
        elif met != NULL:
            vec_push(met, i)
        i = lane_next(c, l)
    return EMPTY


cdef inline void open_lane(Core* c, Lane* l, int s, double offset) noexcept nogil:
    settle_freed(c, s)
    l.seg, l.fpos, l.cur, l.offset = s, 0, c.seg[s].head, offset


cdef Py_ssize_t walk(Core* c, Py_ssize_t n, int32_t* out, bint tails_first, const double* offsets,
                     IdxVec* met) except -1:
    """Up to `n` evictable, unmarked entries in eviction order into `out` (no state change but
    the queues' settling): one-time tails first (`tails_first`), then the k-way merge of the
    segments by score (stamp + offsets[s]), ties to the lower segment, a run taken from one lane
    while it stays below the other heads (`prefix_runs._merged`). Entries passed over (ref_cnt
    not 0, or marked) are appended to `met` when it is not NULL. Returns how many were found."""
    cdef Py_ssize_t got = 0
    cdef int s, k, b, nl = 0, first = 0
    cdef Lane lanes[MAX_SEGS]
    cdef double limit
    if n <= 0:
        return 0
    if tails_first:
        first = 1
        open_lane(c, &lanes[0], TAIL, 0.0)
        if run(c, &lanes[0], INF, out, &got, n, met) == DONE:
            return got
    for s in range(first, c.nsegs):  # each lane's first evictable entry is its head
        open_lane(c, &lanes[nl], s, offsets[s])
        if run(c, &lanes[nl], -INF, out, &got, n, met) == HEAD:
            nl += 1
    while nl:
        b = 0
        limit = INF
        for k in range(1, nl):
            if lanes[k].score < lanes[b].score:
                limit = lanes[b].score
                b = k
            elif lanes[k].score < limit:
                limit = lanes[k].score
        out[got] = lanes[b].head
        got += 1
        if got == n:
            return got
        k = run(c, &lanes[b], limit - lanes[b].offset, out, &got, n, met)
        if k == DONE:
            return got
        if k == EMPTY:
            nl -= 1
            memmove(&lanes[b], &lanes[b + 1], (nl - b) * sizeof(Lane))
    return got


include "_compact_pins.pxi"
include "_compact_batch_ops.pxi"
include "_compact_ghosts.pxi"
include "_compact_prefix_index.pxi"
include "_compact_prefix_evict.pxi"
