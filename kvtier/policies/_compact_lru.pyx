# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled core of `lru` (kvtier.policies.compact): LRU decisions over C arrays.

No Python object per resident block. Per entry: a 40-byte record (block id, ref_cnt, the key's
hash and length, links, flags, sequence number) in one array, the key bytes inline in a second
array of fixed width (the longest key seen up to 64 bytes; a longer key re-lays it, and a key
past 64 bytes has an allocation of its own: _compact_keys.pxi), and two int32 slots of an
open-addressing hash table (linear probing, backward-shift deletion, no tombstones). Arrays grow
as blocks are inserted, doubling, up to `cache_capacity` (at most 2^30) and past it if more
blocks are ever inserted.

The decisions are exactly `LRUCachePolicy`'s, including its evictable accounting: with
`track_pins()` a pinned block met at the head of the order is set *aside* (moved to an aside
list, in the order of its sequence number) instead of being scanned again, and an unpinned aside
block goes into a heap of freed entries (sequence number, entry) that evictions take first. See
kvtier/policies/lru_pure.py for the argument that this is plain LRU order.

`get` returns a `BlockView` of an entry: reads and writes of its `ref_cnt` go to the arrays, so
every later `get` sees them. A view is valid while its block stays resident; using one after its
block left raises LookupError (checked by key and block id), never touches another block.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject_Hash
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.string cimport memcmp, memcpy, memset


cdef enum:
    USED = 1
    PINNED = 2  # reported by `pin` (evictable accounting)
    ASIDE = 4  # in the aside list, not the order
    MARK = 8  # in `protected` during one `evict`
    MAX_KEY = 65535
    MAX_ENTRIES = 1 << 30

ctypedef struct Entry:
    int64_t block_id
    Py_hash_t hash
    int64_t seq  # place in the eviction order while aside
    int32_t prev  # the order (oldest first) or the aside list
    int32_t next  # ...and the free list
    int32_t ref_cnt
    uint16_t klen
    uint8_t flags

ctypedef struct Item:  # an entry of the freed heap
    int64_t seq
    int32_t idx

ctypedef struct Chain:
    int32_t head
    int32_t tail

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
    Chain order
    Chain aside
    Item* heap
    Py_ssize_t hlen
    Py_ssize_t hcap
    Py_ssize_t count
    Py_ssize_t npinned
    int64_t seq


POLICY_NAME = "lru"

include "_compact_table.pxi"


cdef inline void unlink(Core* c, int32_t i) noexcept nogil:
    cdef Chain* l = &c.aside if c.e[i].flags & ASIDE else &c.order
    cdef int32_t p = c.e[i].prev, n = c.e[i].next
    if p >= 0:
        c.e[p].next = n
    else:
        l.head = n
    if n >= 0:
        c.e[n].prev = p
    else:
        l.tail = p


cdef inline void set_aside(Core* c, int32_t i, int64_t seq) noexcept nogil:
    unlink(c, i)
    c.e[i].flags |= ASIDE
    c.e[i].seq = seq
    link_tail(c, &c.aside, i)


cdef void drop(Core* c, int32_t i) noexcept nogil:
    """Forget entry i (remove, evict)."""
    unlink(c, i)
    release(c, i)


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


cdef int unpin_entry(Core* c, int32_t i) except -1:
    """Entry i became evictable (`unpin`): no longer counted as pinned; an aside entry is queued
    in the freed heap (duplicates are skipped when popped)."""
    forget_pin(c, i)
    if c.e[i].flags & ASIDE:
        heap_push(c, Item(c.e[i].seq, i))
    return 0


cdef int scan_head(Core* c, Py_ssize_t need, int32_t* chosen) except -1:
    """Put the `need` oldest evictable, unmarked entries of the order in `chosen`, setting aside
    the pinned and marked (protected) ones met before them; 0 (nothing chosen, the found ones
    set aside after the others, so the order is kept) when there are not that many."""
    cdef int32_t i = c.order.head, nxt
    cdef Py_ssize_t found = 0, j
    cdef uint8_t f
    while i >= 0:
        nxt = c.e[i].next
        f = c.e[i].flags
        if f & PINNED or c.e[i].ref_cnt != 0:
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
        if c.e[i].ref_cnt == 0 and not c.e[i].flags & MARK:
            chosen[got] = i
            got += 1
        i = c.e[i].next
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
        e = &c.e[it.idx]
        if (not e.flags & ASIDE or e.seq != it.seq or e.flags & PINNED
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


include "_compact_pins.pxi"
include "_compact_batch_ops.pxi"
include "_compact_lru_index.pxi"
include "_compact_lru_batch.pxi"
