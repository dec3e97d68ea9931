# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled core of `lru` (kvtier.policies.lru_compiled): LRU's eviction order over the
compiled block table (kvtier/index/_table.pxd).

No Python object per resident block. The table holds each block's 24-byte entry (block id, key
hash, ref_cnt, key length, flags), its key and its hash-table buckets, and grows them with the
16-byte record this module keeps per entry in the table's parallel array: the links of the order
(oldest first) or of the aside list, and the sequence number an aside entry was set aside with.
So 40 bytes of records per block, plus the key (inline up to 64 bytes) and 8 or more bytes of
buckets: about 84 bytes with vLLM's 36-byte keys. The arrays grow as blocks are inserted,
doubling, up to `cache_capacity` (at most 2^30).

The decisions are exactly `LRUCachePolicy`'s, including its evictable accounting: after the
table's first `evictable` notice a pinned block met at the head of the order is set *aside* (moved to an aside
list, in the order of its sequence number) instead of being scanned again, and an unpinned aside
block goes into a heap of freed entries (sequence number, entry) that evictions take first. See
kvtier/policies/lru_pure.py for the argument that this is plain LRU order.

`get` returns a `BlockView` of an entry (kvtier/index/_table_api.pyx): reads and writes of its
`ref_cnt` go to the table, so every later `get` sees them. A view is valid while its block stays
resident; using one after its block left raises LookupError, never touches another block.
"""

from cpython.mem cimport PyMem_Free
from libc.stdint cimport int32_t, int64_t, uint8_t

from kvtier.index._table cimport (
    MARK, PINNED, Chain, Entry, Links, Table, chain_append, chain_remove, claim, forget_all, key_in,
    locate_in, mark_keys, release, reserve, table_bytes, table_free, table_init, unmark_keys,
)
from kvtier.index._table_api cimport CompactTable

from kvtier.index._table_api import BlockView  # noqa: F401  (the class `get` returns, named here as before)


cdef enum:
    ASIDE = 4  # in the aside list, not the order (a flag bit the table leaves to the policy)

ctypedef struct Rec:  # entry i's place in the order: the table's record i
    Links l  # the order (oldest first) or the aside list
    int64_t seq  # place in the eviction order while aside

ctypedef struct Item:  # an entry of the freed heap
    int64_t seq
    int32_t idx

ctypedef struct Core:
    Table t
    Chain order
    Chain aside
    Item* heap
    Py_ssize_t hlen
    Py_ssize_t hcap
    int64_t seq


cdef inline Rec* rec(Core* c, int32_t i) noexcept nogil:
    return (<Rec*>c.t.rec) + i


cdef inline void unlink(Core* c, int32_t i) noexcept nogil:
    chain_remove(&c.t, &c.aside if c.t.e[i].flags & ASIDE else &c.order, i)


cdef inline void set_aside(Core* c, int32_t i, int64_t seq) noexcept nogil:
    unlink(c, i)
    c.t.e[i].flags |= ASIDE
    rec(c, i).seq = seq
    chain_append(&c.t, &c.aside, i)


cdef void drop(Core* c, int32_t i) noexcept nogil:
    """Forget entry i (remove, evict)."""
    unlink(c, i)
    release(&c.t, i)


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


cdef class Index(CompactTable):
    """LRU over the compiled block table (see the module docstring); `kvtier.policies.lru_compiled`
    completes it into a `CachePolicy`. Keys are bytes of at most 65535 bytes."""

    cdef Core c

    def __cinit__(self, cache_capacity, *args, **kwargs):
        table_init(&self.c.t, cache_capacity, sizeof(Rec), "lru")
        self.tp = &self.c.t
        self.c.order = Chain(-1, -1)
        self.c.aside = Chain(-1, -1)

    def __dealloc__(self):
        table_free(&self.c.t)
        PyMem_Free(self.c.heap)

    cdef int32_t put(self, object key, int64_t block_id, int32_t ref_cnt, bint tail) except -1:
        """Enter a block (or overwrite a resident one's values, in the same place, as LRU); its entry."""
        cdef bint fresh
        cdef int32_t i = claim(&self.c.t, key, block_id, ref_cnt, &fresh)
        if fresh:
            rec(&self.c, i).seq = 0
            chain_append(&self.c.t, &self.c.order, i)
        return i

    cdef int unpinned(self, int32_t i) except -1:
        """An aside entry that became evictable is queued in the freed heap (duplicates are
        skipped when popped)."""
        if self.c.t.e[i].flags & ASIDE:
            heap_push(&self.c, Item(rec(&self.c, i).seq, i))
        return 0

    def remove(self, key):
        cdef int32_t i = locate_in(&self.c.t, key)
        if i >= 0:
            drop(&self.c, i)

    def touch(self, keys):
        cdef int32_t i
        cdef Core* c = &self.c
        keys = keys if isinstance(keys, list) else list(keys)
        for key in reversed(keys):
            i = locate_in(&c.t, key)
            if i >= 0:
                unlink(c, i)
                c.t.e[i].flags &= ~ASIDE
                chain_append(&c.t, &c.order, i)

    def keys(self):
        cdef int32_t i
        out = []
        for chain in (self.c.order.head, self.c.aside.head):
            i = chain
            while i >= 0:
                out.append(key_in(&self.c.t, i))
                i = rec(&self.c, i).l.next
        return out

    def clear(self):
        cdef Core* c = &self.c
        forget_all(&c.t)
        c.hlen = 0
        c.order = Chain(-1, -1)
        c.aside = Chain(-1, -1)

    # ------------------------------------------------------------------ decisions
    cdef Py_ssize_t pick(self, Py_ssize_t n, object protected, int32_t* chosen) except -1:
        """`evict`'s victims (`CompactTable.pick`): the freed aside ones, then the order's head;
        protected entries are marked while choosing."""
        cdef Core* c = &self.c
        cdef Py_ssize_t got = 0
        marked = mark_keys(&c.t, protected)
        try:
            got = choose_tracked(c, n, chosen) if self.tracking else choose(c, n, chosen)
        finally:
            unmark_keys(&c.t, marked)
        return got

    cdef int drop_victims(self, int32_t* chosen, Py_ssize_t n) except -1:
        cdef Py_ssize_t j
        for j in range(n):
            drop(&self.c, chosen[j])
        return 0

    def victims(self, Py_ssize_t n, skip=()):
        """The keys `evict(n, skip)` would take now, in its order (freed aside blocks, then the
        order), in one C loop; the order does not depend on `skip`."""
        cdef int32_t i
        cdef Entry* e = self.c.t.e
        if skip:
            return [k for k in self.victims(n + len(skip)) if k not in skip][:n]
        out = []
        heads = [self.c.aside.head, self.c.order.head] if self.tracking else [self.c.order.head]
        for chain in heads:
            i = chain
            while i >= 0 and len(out) < n:
                if e[i].ref_cnt == 0 and not e[i].flags & PINNED:
                    out.append(key_in(&self.c.t, i))
                i = rec(&self.c, i).l.next
        return out

    def memory_bytes(self):
        """Bytes allocated for the arrays now (the table's, the freed heap)."""
        return table_bytes(&self.c.t) + self.c.hcap * sizeof(Item)


cdef class CompactLRUBatch(Index):
    """`Index` with the batch calls `CachePolicy` documents (`readable_run`, `absent`,
    `insert_written`, `pin_loads`, `release_loads`, `mark_written`, `evict_ids`): the same
    answers and side effects as its defaults there, which go key by key through `get`, `pin` and
    `unpin`. They are the table's (`CompactTable`, kvtier/index/_table_api.pyx), one C loop per
    batch, no view per block; this class is the name `kvtier.policies.lru_compiled` builds on."""
