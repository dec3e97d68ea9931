# The hash table and key array of a compiled index (included by _compact_lru.pyx and
# _compact_prefix.pyx, which each define `Entry` (with hash, klen, flags & USED, next),
# `Chain` and `Core` (e, keys, width, cap, want, hw, table, mask, long_bytes) and POLICY_NAME).
#
# The arrays grow as blocks are inserted (doubling, up to `cache_capacity`, then doubling again
# if more are ever inserted), so a large capacity costs nothing until it is used.

include "_compact_keys.pxi"

cdef enum:
    FIRST_ENTRIES = 1024  # entries allocated when an index is made


cdef inline char* key_at(Core* c, int32_t i) noexcept nogil:
    return slot_key(c.keys, c.width, i, c.e[i].klen)


cdef int32_t find(Core* c, const char* kp, Py_ssize_t klen, Py_hash_t h) noexcept nogil:
    cdef size_t s = (<size_t>h) & c.mask
    cdef int32_t i
    while True:
        i = c.table[s]
        if i < 0:
            return -1
        if c.e[i].hash == h and c.e[i].klen == klen and memcmp(key_at(c, i), kp, klen) == 0:
            return i
        s = (s + 1) & c.mask


# An open-addressing table of int32 entry indexes (-1: empty), linear probing, `mask + 1` slots.
# The entries' hashes are read through `hashes` + i * `stride` (the hash field of entry 0 and the
# entry size), so that the index and the ghost list (_compact_ghosts.pxi) share one table code.
cdef inline Py_hash_t hash_of(const char* hashes, size_t stride, int32_t i) noexcept nogil:
    return (<const Py_hash_t*>(hashes + <size_t>i * stride))[0]


cdef inline void slot_put(int32_t* table, size_t mask, Py_hash_t h, int32_t i) noexcept nogil:
    cdef size_t s = (<size_t>h) & mask
    while table[s] >= 0:
        s = (s + 1) & mask
    table[s] = i


cdef void slot_del(int32_t* table, size_t mask, const char* hashes, size_t stride, int32_t i) noexcept nogil:
    """Remove entry i's slot and shift later members of its probe run back (no tombstones)."""
    cdef size_t s = (<size_t>hash_of(hashes, stride, i)) & mask
    cdef size_t j, home
    cdef int32_t k
    while table[s] != i:
        s = (s + 1) & mask
    j = s
    while True:
        j = (j + 1) & mask
        k = table[j]
        if k < 0:
            break
        home = (<size_t>hash_of(hashes, stride, k)) & mask
        # k may fill the hole at s unless its home lies cyclically in (s, j]
        if (s < j and (home <= s or home > j)) or (s > j and home <= s and home > j):
            table[s] = k
            s = j
    table[s] = -1


cdef inline void table_put(Core* c, int32_t i) noexcept nogil:
    slot_put(c.table, c.mask, c.e[i].hash, i)


cdef inline void table_del(Core* c, int32_t i) noexcept nogil:
    slot_del(c.table, c.mask, <const char*>&c.e[0].hash, sizeof(Entry), i)


cdef inline size_t table_slots(Py_ssize_t entries) noexcept nogil:
    """Slots for a table of up to `entries` entries: a power of two, at most half full (>= 8)."""
    cdef size_t slots = 8
    while slots < <size_t>(2 * entries):
        slots *= 2
    return slots


cdef int core_init(Core* c, object cache_capacity) except -1:
    """Arrays for the first entries of an index of `cache_capacity` (checked: a ValueError names
    it); no key array yet (the first key lays it out) and no list (the caller's)."""
    cap = int(cache_capacity)
    if cap <= 0:
        raise ValueError(f"cache_capacity must be > 0 blocks, got {cache_capacity}")
    if cap > MAX_ENTRIES:
        raise ValueError(f"cache_capacity must be <= {MAX_ENTRIES} blocks for {POLICY_NAME} (compiled), got {cap}")
    c.want = cap
    c.cap = min(cap, FIRST_ENTRIES)
    c.e = <Entry*>PyMem_Malloc(c.cap * sizeof(Entry))
    if c.e == NULL:
        raise MemoryError()
    c.free = -1
    rebuild_table(c, table_slots(c.cap))
    return 0


cdef void forget_long_keys(Core* c) noexcept nogil:
    """Free the allocations of the resident long keys (their entries are about to be forgotten)."""
    cdef int32_t i
    if c.long_bytes == 0:
        return
    for i in range(c.hw):
        if c.e[i].flags & USED:
            slot_free(c.keys, c.width, i, c.e[i].klen)
    c.long_bytes = 0


cdef void core_free(Core* c) noexcept:
    if c.e != NULL:
        forget_long_keys(c)
    PyMem_Free(c.e)
    PyMem_Free(c.keys)
    PyMem_Free(c.table)


cdef int rebuild_table(Core* c, size_t slots) except -1:
    cdef int32_t* table = <int32_t*>PyMem_Malloc(slots * sizeof(int32_t))
    cdef int32_t i
    if table == NULL:
        raise MemoryError()
    memset(table, 0xff, slots * sizeof(int32_t))
    PyMem_Free(c.table)
    c.table, c.mask = table, slots - 1
    for i in range(c.hw):
        if c.e[i].flags & USED:
            table_put(c, i)
    return 0


cdef int grow(Core* c) except -1:
    """Double the entry arrays (up to `cache_capacity` while below it; past it when more blocks
    than that are inserted)."""
    cdef int32_t cap
    cdef void* p
    if c.cap >= MAX_ENTRIES:
        raise MemoryError(f"{POLICY_NAME} (compiled) holds at most {MAX_ENTRIES} blocks")
    cap = min(2 * c.cap, c.want) if c.cap < c.want else 2 * c.cap
    p = PyMem_Realloc(c.e, cap * sizeof(Entry))
    if p == NULL:
        raise MemoryError()
    c.e = <Entry*>p
    if c.keys != NULL:
        p = PyMem_Realloc(c.keys, cap * c.width)
        if p == NULL:
            raise MemoryError()
        c.keys = <char*>p
    c.cap = cap
    if c.mask + 1 < 2 * <size_t>cap:
        rebuild_table(c, 2 * (c.mask + 1))
    return 0


cdef int widen(Core* c, Py_ssize_t width) except -1:
    """Re-lay the key array for keys of up to `width` bytes."""
    cdef char* keys = <char*>PyMem_Malloc(<Py_ssize_t>c.cap * width)
    cdef int32_t i
    if keys == NULL:
        raise MemoryError()
    if c.keys != NULL:
        for i in range(c.hw):
            if c.e[i].flags & USED:
                slot_move(keys, width, i, c.keys, c.width, i, c.e[i].klen)
        PyMem_Free(c.keys)
    c.keys, c.width = keys, width
    return 0


cdef inline void link_tail(Core* c, Chain* l, int32_t i) noexcept nogil:
    c.e[i].next = -1
    c.e[i].prev = l.tail
    if l.tail >= 0:
        c.e[l.tail].next = i
    else:
        l.head = i
    l.tail = i


cdef inline int32_t locate_in(Core* c, object key) except -2:
    """The entry of `key`, or -1 (not resident; not bytes, or longer than any inline key entered)."""
    cdef Py_ssize_t klen
    if not PyBytes_Check(key):
        return -1
    klen = PyBytes_GET_SIZE(key)
    if c.count == 0 or (klen <= INLINE_KEY and klen > c.width):
        return -1
    return find(c, PyBytes_AS_STRING(key), klen, PyObject_Hash(key))


cdef inline object key_in(Core* c, int32_t i):
    return PyBytes_FromStringAndSize(key_at(c, i), c.e[i].klen)


cdef int32_t claim(Core* c, object key, int64_t block_id, int32_t ref_cnt, bint* fresh) except -1:
    """The entry for `key` with these values: a resident one overwritten (`fresh` False), or a new
    one in the table, counted, linked nowhere (`fresh` True: the caller links it)."""
    cdef Py_ssize_t klen
    cdef Py_hash_t h
    cdef int32_t i
    cdef char* copy = NULL
    if not PyBytes_Check(key):
        raise TypeError(f"{POLICY_NAME}: a key must be bytes (an OffloadKey), got {type(key).__name__}")
    klen = PyBytes_GET_SIZE(key)
    if klen > MAX_KEY:
        raise ValueError(f"{POLICY_NAME}: a key must be at most {MAX_KEY} bytes, got {klen}")
    h = PyObject_Hash(key)
    if c.keys == NULL or slot_width(klen) > c.width:
        widen(c, max(slot_width(klen), c.width, 1))
    i = find(c, PyBytes_AS_STRING(key), klen, h) if c.count else -1
    if i >= 0:
        c.e[i].block_id, c.e[i].ref_cnt = block_id, ref_cnt
        fresh[0] = False
        return i
    if c.free < 0 and c.hw == c.cap:
        grow(c)
    if klen > INLINE_KEY:  # before an entry is taken: nothing fails after that
        copy = long_copy(PyBytes_AS_STRING(key), klen)
        c.long_bytes += klen
    if c.free >= 0:
        i = c.free
        c.free = c.e[i].next
    else:
        i = c.hw
        c.hw += 1
    c.e[i].block_id, c.e[i].ref_cnt, c.e[i].hash = block_id, ref_cnt, h
    c.e[i].klen, c.e[i].flags = <uint16_t>klen, USED
    slot_fill(c.keys, c.width, i, PyBytes_AS_STRING(key), klen, copy)
    table_put(c, i)
    c.count += 1
    fresh[0] = True
    return i


cdef int32_t* entries_of(Core* c, list keys, bint resident) except NULL:
    """The entries of `keys` (PyMem_Malloc'd, for the caller to free); -1 for a key not resident.
    With `resident`, raises KeyError (nothing allocated) unless all are."""
    cdef Py_ssize_t n = len(keys), j
    cdef int32_t* idx = <int32_t*>PyMem_Malloc(max(n, 1) * sizeof(int32_t))
    if idx == NULL:
        raise MemoryError()
    for j in range(n):
        idx[j] = locate_in(c, keys[j])
        if resident and idx[j] < 0:
            PyMem_Free(idx)
            raise KeyError(keys[j])
    return idx


cdef int reserve(void** items, Py_ssize_t n, Py_ssize_t* cap, size_t size) except -1:
    """Room for item `n` of a growable array of `size`-byte items (doubled, at least 16)."""
    cdef void* p
    if n < cap[0]:
        return 0
    cap[0] = max(16, 2 * cap[0])
    p = PyMem_Realloc(items[0], cap[0] * size)
    if p == NULL:
        raise MemoryError()
    items[0] = p
    return 0


cdef inline void forget_pin(Core* c, int32_t i) noexcept nogil:
    """Entry i is no longer counted as pinned."""
    if c.e[i].flags & PINNED:
        c.e[i].flags &= ~PINNED
        c.npinned -= 1


cdef void release(Core* c, int32_t i) noexcept nogil:
    """Entry i out of the table and the pin count, onto the free list (it is linked nowhere)."""
    table_del(c, i)
    forget_pin(c, i)
    if c.e[i].klen > INLINE_KEY:
        slot_free(c.keys, c.width, i, c.e[i].klen)
        c.long_bytes -= c.e[i].klen
    c.e[i].flags = 0
    c.e[i].next = c.free
    c.free = i
    c.count -= 1


cdef void forget_all(Core* c) noexcept nogil:
    """No entry resident, none pinned (`clear`; the caller resets its lists). The used entries
    are marked unused, so that a view of one fails its check instead of reading stale values."""
    cdef int32_t i
    forget_long_keys(c)
    for i in range(c.hw):
        c.e[i].flags = 0
    memset(c.table, 0xff, (c.mask + 1) * sizeof(int32_t))
    c.hw, c.free, c.count, c.npinned = 0, -1, 0, 0
