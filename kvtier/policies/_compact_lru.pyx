# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled order of `lru` (kvtier.policies.lru_compiled): `LRUOrder`, LRU's eviction order
composed into a compiled block table (`CompactTable`, kvtier/index/_table_api.pyx).

No Python object per resident block. The table holds each block's 24-byte entry, its key and its
buckets, and grows with them the 16-byte record this order keeps per entry: the links of the
order (oldest first) or of the aside list, and the sequence number an aside entry was set aside
with. About 84 bytes per block with vLLM's 36-byte keys (docs/policies.md).

The decisions are exactly `PureLRUCachePolicy`'s, including its use of the table's evictable
notices: once the table tracks pins, a pinned block met at the head of the order is set *aside*
(moved to an aside list, in the order of its sequence number) instead of being scanned again, and
an unpinned aside block goes into a heap of freed entries (sequence number, entry) that
evictions take first. See kvtier/policies/lru_pure.py for why this is plain LRU order.
"""

from cpython.mem cimport PyMem_Free
from libc.stdint cimport int32_t, int64_t, uint8_t

from kvtier.index._table cimport MARK, PINNED, Chain, Entry, Links, Table, chain_append, chain_remove, key_in, locate_in, reserve
from kvtier.index._table_api cimport CompactOrder


cdef enum:
    ASIDE = 4  # in the aside list, not the order (a flag bit the table leaves to the policy)

ctypedef struct Rec:  # entry i's place in the order: the table's record i
    Links l  # the order (oldest first) or the aside list
    int64_t seq  # place in the eviction order while aside

ctypedef struct Item:  # an entry of the freed heap
    int64_t seq
    int32_t idx

ctypedef struct Core:
    Table* t  # the table the order is composed into
    Chain order
    Chain aside
    Item* heap
    Py_ssize_t hlen
    Py_ssize_t hcap
    int64_t seq


cdef inline Rec* rec(Core* c, int32_t i) noexcept nogil:
    return (<Rec*>c.t.rec) + i


cdef inline void unlink(Core* c, int32_t i) noexcept nogil:
    chain_remove(c.t, &c.aside if c.t.e[i].flags & ASIDE else &c.order, i)


cdef inline void set_aside(Core* c, int32_t i, int64_t seq) noexcept nogil:
    unlink(c, i)
    c.t.e[i].flags |= ASIDE
    rec(c, i).seq = seq
    chain_append(c.t, &c.aside, i)


cdef inline bint before(Item a, Item b) noexcept nogil:
    return a.seq < b.seq or (a.seq == b.seq and a.idx < b.idx)


cdef int heap_push(Core* c, Item it) except -1:
    cdef Py_ssize_t k = c.hlen, parent
    reserve(<void**>&c.heap, c.hlen, &c.hcap, sizeof(Item))
    c.hlen += 1
    while k > 0:
        parent = (k - 1) >> 1
        if not before(it, c.heap[parent]):
            break
        c.heap[k] = c.heap[parent]
        k = parent
    c.heap[k] = it
    return 0


cdef Item heap_pop(Core* c) noexcept nogil:
    cdef Item top = c.heap[0], last
    cdef Py_ssize_t k = 0, child
    c.hlen -= 1
    last = c.heap[c.hlen]
    while True:
        child = 2 * k + 1
        if child >= c.hlen:
            break
        if child + 1 < c.hlen and before(c.heap[child + 1], c.heap[child]):
            child += 1
        if not before(c.heap[child], last):
            break
        c.heap[k] = c.heap[child]
        k = child
    if c.hlen:
        c.heap[k] = last
    return top


cdef int scan_head(Core* c, Py_ssize_t need, int32_t* chosen) except -1:
    """Put the `need` oldest evictable, unmarked entries of the order in `chosen`, setting aside
    the pinned and marked (protected) ones met before them; 0 (nothing chosen, the found ones
    set aside after the others, so the order is kept) when there are not that many."""
    cdef int32_t i = c.order.head, nxt
    cdef Py_ssize_t found = 0, j
    cdef uint8_t f
    while i >= 0:
        nxt = rec(c, i).l.next
        f = c.t.e[i].flags
        if f & PINNED or c.t.e[i].ref_cnt != 0:
            set_aside(c, i, c.seq)
            c.seq += 1
        elif f & MARK:
            set_aside(c, i, c.seq)
            heap_push(c, Item(c.seq, i))
            c.seq += 1
        else:
            chosen[found] = i
            found += 1
            if found == need:
                return need
        i = nxt
    for j in range(found):
        set_aside(c, chosen[j], c.seq)
        heap_push(c, Item(c.seq, chosen[j]))
        c.seq += 1
    return 0


cdef Py_ssize_t choose(Core* c, Py_ssize_t n, int32_t* chosen) except -1:
    """Without accounting: the n oldest blocks with ref_cnt 0 and no mark, or 0."""
    cdef int32_t i = c.order.head
    cdef Py_ssize_t got = 0
    while i >= 0 and got < n:
        if c.t.e[i].ref_cnt == 0 and not c.t.e[i].flags & MARK:
            chosen[got] = i
            got += 1
        i = rec(c, i).l.next
    return got if got == n else 0


cdef Py_ssize_t choose_tracked(Core* c, Py_ssize_t n, int32_t* chosen) except -1:
    """With accounting (LRUCachePolicy._evict_tracked): freed aside entries first, oldest
    first, then the order's head (`scan_head`); 0 when there are too few."""
    cdef Py_ssize_t got = 0, found
    cdef Item it, last = Item(-1, -1)
    cdef Entry* e
    taken, kept = [], []
    while c.hlen and got < n:
        it = heap_pop(c)
        e = &c.t.e[it.idx]
        if (not e.flags & ASIDE or rec(c, it.idx).seq != it.seq or e.flags & PINNED
                or (it.seq == last.seq and it.idx == last.idx)):
            continue  # stale (touched, removed, evicted, pinned again) or a duplicate
        last = it
        if e.flags & MARK or e.ref_cnt != 0:
            kept.append((it.seq, it.idx))
        else:
            taken.append((it.seq, it.idx))
            chosen[got] = it.idx
            got += 1
    if got < n:
        found = scan_head(c, n - got, chosen + got)
        if found:
            got += found
        else:
            kept += taken
            got = 0
    for seq, idx in kept:
        heap_push(c, Item(seq, idx))
    return got


cdef class LRUOrder(CompactOrder):
    """LRU's eviction order, composed into a `CompactTable` (see the module docstring):
    `kvtier.policies.lru_compiled.LRUCachePolicy` makes the pair."""

    cdef Core c

    def __cinit__(self, *args, **kwargs):
        self.rec_size = sizeof(Rec)
        self.label = "lru"
        self.c.order = Chain(-1, -1)
        self.c.aside = Chain(-1, -1)

    def __dealloc__(self):
        PyMem_Free(self.c.heap)

    cdef int attached(self) except -1:
        self.c.t = self.t
        return 0

    cdef int entered(self, int32_t i, bint tail) except -1:
        rec(&self.c, i).seq = 0
        chain_append(self.c.t, &self.c.order, i)
        return 0

    cdef int leaving(self, int32_t i) except -1:
        unlink(&self.c, i)
        return 0

    cdef int unpinned(self, int32_t i) except -1:
        """An aside entry that became evictable is queued in the freed heap (duplicates are
        skipped when popped)."""
        if self.c.t.e[i].flags & ASIDE:
            heap_push(&self.c, Item(rec(&self.c, i).seq, i))
        return 0

    cdef int touched(self, list keys) except -1:
        cdef int32_t i
        cdef Core* c = &self.c
        for key in reversed(keys):
            i = locate_in(c.t, key)
            if i >= 0:
                unlink(c, i)
                c.t.e[i].flags &= ~ASIDE
                chain_append(c.t, &c.order, i)
        return 0

    cdef int cleared(self) except -1:
        self.c.hlen = 0
        self.c.order = Chain(-1, -1)
        self.c.aside = Chain(-1, -1)
        return 0

    # ------------------------------------------------------------------ decisions
    cdef Py_ssize_t pick(self, Py_ssize_t n, int32_t* chosen) except -1:
        """`evict`'s victims: the freed aside ones, then the order's head."""
        return choose_tracked(&self.c, n, chosen) if self.c.t.tracking else choose(&self.c, n, chosen)

    cdef int evicting(self, int32_t* chosen, Py_ssize_t n) except -1:
        cdef Py_ssize_t j
        for j in range(n):
            unlink(&self.c, chosen[j])
        return 0

    def victims(self, Py_ssize_t n, skip=()):
        """The keys `evict(n, skip)` would take now, in its order (freed aside blocks, then the
        order), in one C loop; the order does not depend on `skip`."""
        cdef int32_t i
        cdef Entry* e
        if self.t == NULL:
            raise RuntimeError("lru: this order is not part of a table")
        if skip:
            return [k for k in self.victims(n + len(skip)) if k not in skip][:n]
        e = self.c.t.e
        out = []
        heads = [self.c.aside.head, self.c.order.head] if self.c.t.tracking else [self.c.order.head]
        for chain in heads:
            i = chain
            while i >= 0 and len(out) < n:
                if e[i].ref_cnt == 0 and not e[i].flags & PINNED:
                    out.append(key_in(self.c.t, i))
                i = rec(&self.c, i).l.next
        return out

    def memory_bytes(self):
        """Bytes allocated for the order's own arrays now (the freed heap; its records are the table's)."""
        return self.c.hcap * sizeof(Item)
