# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The eviction order of the compiled prefix-freq (`PrefixFreqCachePolicy`'s, kvtier/policies/
prefix_pure.py), over the compiled block table (kvtier/index/_table.pxd).

Per entry, in the table's parallel record array, a 24-byte `Rec`: the links of its segment's list,
its stamp, and the sequence number it was set aside with; its segment is the entry's spare byte.
- a segment is a doubly-linked list of entries (stamps increase along it);
- an *aside* entry (pinned or protected when an eviction's walk met it) is out of its list; the
  unpinned ones are queued per segment as (stamp, sequence number, entry) and read, sorted, before
  the list (`AsideBlocks`' rule, kvtier/policies/prefix_aside.py);
- `walk` finds victims in eviction order: one-time tails first, then the k-way merge of the
  segments by score (`prefix_runs._merged`).
"""

from cpython.mem cimport PyMem_Free
from libc.stdlib cimport qsort
from libc.string cimport memmove

from kvtier.index._table cimport MARK, PINNED, USED, reserve

cdef double INF = float("inf")


ctypedef struct Lane:  # one segment during a walk (`PrefixFreqCachePolicy._heads`)
    double score  # its head's stamp + offset
    double offset  # credit * unit (tails: 0)
    int32_t head  # its first evictable, unmarked entry
    int32_t cur  # the next list entry to read (-1: none)
    Py_ssize_t fpos  # the next freed item to read
    int seg


cdef int push_freed(Core* c, int32_t i) except -1:
    """Queue aside entry i, evictable now, in its segment's freed list."""
    cdef FreedList* f = &c.freed[c.t.e[i].spare]
    reserve(<void**>&f.items, f.n, &f.cap, sizeof(Freed))
    f.items[f.n] = Freed(rec(c, i).stamp, rec(c, i).seq, i)
    f.n += 1
    f.pushed = True
    return 0


cdef int set_aside(Core* c, int32_t i) except -1:
    """Take entry i (met pinned or protected by an eviction) out of its list; queued at once
    when it is evictable (protected this time)."""
    unlink(c, i)
    c.t.e[i].flags |= ASIDE
    rec(c, i).seq = c.seq
    c.seq += 1
    if not c.t.e[i].flags & PINNED:
        push_freed(c, i)
    return 0


cdef void leave(Core* c, int32_t i) noexcept nogil:
    """Entry i leaves the order (remove, evict; the table releases it next); its queued items go stale."""
    if not c.t.e[i].flags & ASIDE:
        unlink(c, i)


cdef void order_clear(Core* c) noexcept nogil:
    """Every list and queue empty (`clear`, after the table forgot its entries)."""
    cdef int s
    for s in range(MAX_SEGS):
        c.seg[s] = Chain(-1, -1)
        c.freed[s].n = 0


cdef void order_free(Core* c) noexcept:
    cdef int s
    for s in range(MAX_SEGS):
        PyMem_Free(c.freed[s].items)


cdef size_t order_bytes(Core* c) noexcept nogil:
    """Bytes allocated for the queues (the records are the table's)."""
    cdef size_t items = 0
    cdef int s
    for s in range(MAX_SEGS):
        items += c.freed[s].cap
    return items * sizeof(Freed)


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
    for j in range(f.n):
        it = f.items[j]
        if (c.t.e[it.idx].flags & USED and c.t.e[it.idx].flags & ASIDE and c.t.e[it.idx].spare == s
                and rec(c, it.idx).seq == it.seq):
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
        if not c.t.e[i].flags & PINNED:
            return i
    i = l.cur
    if i >= 0:
        l.cur = rec(c, i).l.next
    return i


cdef int vec_push(IdxVec* v, int32_t i) except -1:
    reserve(<void**>&v.v, v.n, &v.cap, sizeof(int32_t))
    v.v[v.n] = i
    v.n += 1
    return 0


cdef inline bint takeable(Core* c, int32_t i) noexcept nogil:
    # (PINNED without a ref_cnt: held by a retention, `CompactTable.hold`)
    return c.t.e[i].ref_cnt == 0 and not c.t.e[i].flags & (MARK | PINNED)


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
            if rec(c, i).stamp >= below:
                l.head, l.score = i, rec(c, i).stamp + l.offset
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
    not 0, pinned or marked) are appended to `met` when it is not NULL. Returns how many were found."""
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
