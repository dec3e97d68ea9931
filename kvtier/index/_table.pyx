# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled block table of a tier: key -> entry (slot, state, pins), over C arrays.

The layout is declared once, in kvtier/index/_table.pxd: per resident block a 24-byte `Entry`
(block id, key hash, ref_cnt, key length, flags, a byte for the policy), the policy's record in a
parallel array the table grows with it (lru: 16 bytes, prefix-freq: 24), the key in a slot of a
key array (inline up to 64 bytes, a longer one allocated on its own) and two int32 buckets of an
open-addressing hash table. So a block costs 40 (lru) or 48 (prefix-freq) bytes of records, the
key and 8 bytes of buckets: with vLLM's 36-byte keys about 84 and 92 bytes.

Here: the arrays (made, grown, freed), entries in and out (`claim`, `release`, `forget_all`), the
key slots' and hash tables' functions that are not inline, pins and protected marks. The table
object (`CompactTable`, kvtier/index/_table_api.pyx) is composed with one compiled eviction order
(kvtier/policies/_compact_lru.pyx, _compact_prefix*.pyx), which `cimport`s this layout to keep its
records and lists. Where these modules are not built, the policies' pure-Python twins run behind
`kvtier.index.PolicyTable` (the same answers, tests/policies/test_lru_batch.py).
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdlib cimport malloc
from libc.string cimport memset


# ---------------------------------------------------------------------- keys and hash tables
cdef char* long_copy(const char* kp, Py_ssize_t klen) except NULL:
    """A key longer than INLINE_KEY copied into an allocation of its own (for `slot_fill`)."""
    cdef char* p = <char*>malloc(klen)
    if p == NULL:
        raise MemoryError()
    memcpy(p, kp, klen)
    return p


cdef void slot_del(int32_t* buckets, size_t mask, const char* hashes, size_t stride, int32_t i) noexcept nogil:
    """Remove entry i's bucket and shift later members of its probe run back (no tombstones)."""
    cdef size_t s = (<size_t>hash_of(hashes, stride, i)) & mask
    cdef size_t j, home
    cdef int32_t k
    while buckets[s] != i:
        s = (s + 1) & mask
    j = s
    while True:
        j = (j + 1) & mask
        k = buckets[j]
        if k < 0:
            break
        home = (<size_t>hash_of(hashes, stride, k)) & mask
        # k may fill the hole at s unless its home lies cyclically in (s, j]
        if (s < j and (home <= s or home > j)) or (s > j and home <= s and home > j):
            buckets[s] = k
            s = j
    buckets[s] = -1


cdef inline void table_put(Table* t, int32_t i) noexcept nogil:
    slot_put(t.buckets, t.mask, t.e[i].hash, i)


cdef int rebuild_buckets(Table* t, size_t slots) except -1:
    cdef int32_t* buckets = <int32_t*>PyMem_Malloc(slots * sizeof(int32_t))
    cdef int32_t i
    if buckets == NULL:
        raise MemoryError()
    memset(buckets, 0xff, slots * sizeof(int32_t))
    PyMem_Free(t.buckets)
    t.buckets, t.mask = buckets, slots - 1
    for i in range(t.hw):
        if t.e[i].flags & USED:
            table_put(t, i)
    return 0


# ---------------------------------------------------------------------- the arrays
cdef int table_init(Table* t, object cache_capacity, size_t rec_size, const char* label) except -1:
    """Arrays for the first entries of a table of `cache_capacity` (checked: a ValueError names
    it) and records of `rec_size` bytes (a policy's, starting with its Links); no key array yet
    (the first key lays it out)."""
    t.label = label
    cap = int(cache_capacity)
    if cap <= 0:
        raise ValueError(f"cache_capacity must be > 0 blocks, got {cache_capacity}")
    if cap > MAX_ENTRIES:
        raise ValueError(f"cache_capacity must be <= {MAX_ENTRIES} blocks for {label.decode()} (compiled), "
                         f"got {cap}")
    t.want = cap
    t.cap = min(cap, FIRST_ENTRIES)
    t.rec_size = rec_size
    t.e = <Entry*>PyMem_Malloc(t.cap * sizeof(Entry))
    t.rec = <char*>PyMem_Malloc(t.cap * rec_size)
    if t.e == NULL or t.rec == NULL:
        raise MemoryError()
    t.free = -1
    rebuild_buckets(t, table_slots(t.cap))
    return 0


cdef void forget_long_keys(Table* t) noexcept nogil:
    """Free the allocations of the resident long keys (their entries are about to be forgotten)."""
    cdef int32_t i
    if t.long_bytes == 0:
        return
    for i in range(t.hw):
        if t.e[i].flags & USED:
            slot_free(t.keys, t.width, i, t.e[i].klen)
    t.long_bytes = 0


cdef void table_free(Table* t) noexcept:
    if t.e != NULL:
        forget_long_keys(t)
    PyMem_Free(t.e)
    PyMem_Free(t.rec)
    PyMem_Free(t.keys)
    PyMem_Free(t.buckets)


cdef int resize(void** p, size_t size) except -1:
    cdef void* q = PyMem_Realloc(p[0], size)
    if q == NULL:
        raise MemoryError()
    p[0] = q
    return 0


cdef int grow(Table* t) except -1:
    """Double the arrays (up to `cache_capacity` while below it; past it when more blocks than
    that are inserted)."""
    cdef int32_t cap
    if t.cap >= MAX_ENTRIES:
        raise MemoryError(f"{t.label.decode()} (compiled) holds at most {MAX_ENTRIES} blocks")
    cap = min(2 * t.cap, t.want) if t.cap < t.want else 2 * t.cap
    resize(<void**>&t.e, cap * sizeof(Entry))
    resize(<void**>&t.rec, cap * t.rec_size)
    if t.keys != NULL:
        resize(<void**>&t.keys, cap * t.width)
    t.cap = cap
    if t.mask + 1 < 2 * <size_t>cap:
        rebuild_buckets(t, 2 * (t.mask + 1))
    return 0


cdef int widen(Table* t, Py_ssize_t width) except -1:
    """Re-lay the key array for keys of up to `width` bytes."""
    cdef char* keys = <char*>PyMem_Malloc(<Py_ssize_t>t.cap * width)
    cdef int32_t i
    if keys == NULL:
        raise MemoryError()
    if t.keys != NULL:
        for i in range(t.hw):
            if t.e[i].flags & USED:
                slot_move(keys, width, i, t.keys, t.width, i, t.e[i].klen)
        PyMem_Free(t.keys)
    t.keys, t.width = keys, width
    return 0


cdef size_t table_bytes(Table* t) noexcept nogil:
    """Bytes allocated for the arrays now (entries, records, keys, long keys, buckets)."""
    return (<size_t>t.cap * (sizeof(Entry) + t.rec_size + t.width) + t.long_bytes
            + (t.mask + 1) * sizeof(int32_t))


cdef int reserve(void** items, Py_ssize_t n, Py_ssize_t* cap, size_t size) except -1:
    """Room for item `n` of a growable array of `size`-byte items (doubled, at least 16)."""
    if n < cap[0]:
        return 0
    cap[0] = max(16, 2 * cap[0])
    return resize(items, cap[0] * size)


# ---------------------------------------------------------------------- entries in and out
cdef int32_t claim(Table* t, object key, int64_t block_id, int32_t ref_cnt, bint* fresh) except -1:
    """The entry for `key` with these values: a resident one overwritten (`fresh` False), or a new
    one in the table, counted, its record untouched (`fresh` True: the policy places it)."""
    cdef Py_ssize_t klen
    cdef Py_hash_t h
    cdef int32_t i
    cdef char* copy = NULL
    if not PyBytes_Check(key):
        raise TypeError(f"{t.label.decode()}: a key must be bytes (an OffloadKey), got {type(key).__name__}")
    klen = PyBytes_GET_SIZE(key)
    if klen > MAX_KEY:
        raise ValueError(f"{t.label.decode()}: a key must be at most {MAX_KEY} bytes, got {klen}")
    h = PyObject_Hash(key)
    if t.keys == NULL or slot_width(klen) > t.width:
        widen(t, max(slot_width(klen), t.width, 1))
    i = find(t, PyBytes_AS_STRING(key), klen, h) if t.count else -1
    if i >= 0:
        t.e[i].block_id, t.e[i].ref_cnt = block_id, ref_cnt
        fresh[0] = False
        return i
    if t.free < 0 and t.hw == t.cap:
        grow(t)
    if klen > INLINE_KEY:  # before an entry is taken: nothing fails after that
        copy = long_copy(PyBytes_AS_STRING(key), klen)
        t.long_bytes += klen
    if t.free >= 0:
        i = t.free
        t.free = <int32_t>t.e[i].block_id
    else:
        i = t.hw
        t.hw += 1
    t.e[i].block_id, t.e[i].ref_cnt, t.e[i].hash = block_id, ref_cnt, h
    t.e[i].klen, t.e[i].flags, t.e[i].spare = <uint16_t>klen, USED, 0
    slot_fill(t.keys, t.width, i, PyBytes_AS_STRING(key), klen, copy)
    table_put(t, i)
    t.count += 1
    fresh[0] = True
    return i


cdef void release(Table* t, int32_t i) noexcept nogil:
    """Entry i out of the table and the pin count, onto the free list (the policy unlinked it)."""
    slot_del(t.buckets, t.mask, <const char*>&t.e[0].hash, sizeof(Entry), i)
    forget_pin(t, i)
    if t.e[i].klen > INLINE_KEY:
        slot_free(t.keys, t.width, i, t.e[i].klen)
        t.long_bytes -= t.e[i].klen
    t.e[i].flags = 0
    t.e[i].block_id = t.free
    t.free = i
    t.count -= 1


cdef void forget_all(Table* t) noexcept nogil:
    """No entry resident, none pinned (`clear`; the policy resets its lists). The used entries
    are marked unused, so that a view of one fails its check instead of reading stale values."""
    cdef int32_t i
    forget_long_keys(t)
    for i in range(t.hw):
        t.e[i].flags = 0
    memset(t.buckets, 0xff, (t.mask + 1) * sizeof(int32_t))
    t.hw, t.free, t.count, t.npinned = 0, -1, 0, 0


cdef int32_t* entries_of(Table* t, list keys, bint resident) except NULL:
    """The entries of `keys` (PyMem_Malloc'd, for the caller to free); -1 for a key not resident.
    With `resident`, raises KeyError (nothing allocated) unless all are."""
    cdef Py_ssize_t n = len(keys), j
    cdef int32_t* idx = <int32_t*>PyMem_Malloc(max(n, 1) * sizeof(int32_t))
    if idx == NULL:
        raise MemoryError()
    for j in range(n):
        idx[j] = locate_in(t, keys[j])
        if resident and idx[j] < 0:
            PyMem_Free(idx)
            raise KeyError(keys[j])
    return idx


# ---------------------------------------------------------------------- pins and marks
cdef void pin_by_ref_cnt(Table* t) noexcept nogil:
    """The first `evictable` notice: the resident entries whose ref_cnt is not 0, or held, are the pinned ones."""
    cdef int32_t i
    t.npinned = 0
    for i in range(t.hw):
        if t.e[i].flags & USED:
            t.e[i].flags &= ~PINNED
            if t.e[i].ref_cnt != 0 or t.e[i].flags & HELD:
                pin_entry(t, i)


cdef Py_ssize_t evictable_in(Table* t, object protected) except -1:
    """`BlockTable.evictable_count`: resident, unpinned entries not in `protected`."""
    cdef int32_t i
    cdef Py_ssize_t free = t.count - t.npinned
    for key in protected:
        i = locate_in(t, key)
        if i >= 0 and not t.e[i].flags & PINNED:
            free -= 1
    return free


cdef bint refuses_in(Table* t, Py_ssize_t n, object protected) except -1:
    """Whether `evict` must refuse, with pins tracked: fewer than n evictable, unprotected entries."""
    if t.count - t.npinned >= n + len(protected):
        return False
    return evictable_in(t, protected) < n


cdef list mark_keys(Table* t, object keys):
    """Mark the resident entries of `keys` (`protected` during one walk); the entries marked."""
    cdef int32_t i
    marked = []
    for key in keys:
        i = locate_in(t, key)
        if i >= 0 and not t.e[i].flags & MARK:
            t.e[i].flags |= MARK
            marked.append(i)
    return marked


cdef void unmark_keys(Table* t, list marked):
    cdef int32_t i
    for i in marked:
        t.e[i].flags &= ~MARK
