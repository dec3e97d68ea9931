# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The ghost list of the compiled prefix-freq: evicted keys and the segment each was evicted from,
oldest first, in C arrays (`GhostList`'s rules, exactly; kvtier/policies/prefix_ghosts.py).

Entries are appended in eviction order; a key stored again leaves a dead entry behind, dropped
when the array is compacted (when it is full, and at each trim). A key's bytes sit in a slot of
fixed width (the longest key seen, up to 64 bytes; a longer key has an allocation of its own,
owned by its ghost while it is alive), and an open-addressing table of int32 entry numbers finds
them: the key slots and hash-table code of the compiled block table (kvtier/index/_table.pxd).
About 50 bytes per ghost for 36-byte keys, against ~145 for a bytes object in a dict.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memset

from kvtier.index._table cimport (
    INLINE_KEY, long_copy, slot_del, slot_fill, slot_find, slot_free, slot_key, slot_move, slot_put, slot_width,
    table_slots,
)


cdef inline char* ghost_key(Ghosts* gs, Py_ssize_t i) noexcept nogil:
    return slot_key(gs.keys, gs.width, i, gs.g[i].klen)


cdef Py_ssize_t ghost_find(Ghosts* gs, const char* kp, Py_ssize_t klen, Py_hash_t h) noexcept nogil:
    if gs.table == NULL:
        return -1
    return slot_find(gs.table, gs.mask, <const char*>&gs.g[0].hash, <const char*>&gs.g[0].klen, sizeof(Ghost),
                     gs.keys, gs.width, kp, klen, h)


cdef inline void ghost_table_put(Ghosts* gs, int32_t i) noexcept nogil:
    slot_put(gs.table, gs.mask, gs.g[i].hash, i)


cdef inline void ghost_table_del(Ghosts* gs, int32_t i) noexcept nogil:
    slot_del(gs.table, gs.mask, <const char*>&gs.g[0].hash, sizeof(Ghost), i)


cdef int ghost_layout(Ghosts* gs, Py_ssize_t cap, Py_ssize_t width, Py_ssize_t keep_from) except -1:
    """Re-lay the arrays for `cap` entries of slots of `width` bytes, keeping the live entries
    from index `keep_from` on (older ones are dropped, their long keys freed), in order; the
    table rebuilt."""
    cdef Ghost* g = <Ghost*>PyMem_Malloc(max(cap, 1) * sizeof(Ghost))
    cdef char* keys = <char*>PyMem_Malloc(max(cap * width, 1))
    cdef size_t slots = table_slots(cap)
    cdef int32_t* table
    cdef Py_ssize_t i, k = 0
    table = <int32_t*>PyMem_Malloc(slots * sizeof(int32_t))
    if g == NULL or keys == NULL or table == NULL:
        PyMem_Free(g)
        PyMem_Free(keys)
        PyMem_Free(table)
        raise MemoryError()
    memset(table, 0xff, slots * sizeof(int32_t))
    for i in range(keep_from):
        if gs.g[i].alive:
            slot_free(gs.keys, gs.width, i, gs.g[i].klen)
    for i in range(keep_from, gs.n):
        if gs.g[i].alive:
            g[k] = gs.g[i]
            slot_move(keys, width, k, gs.keys, gs.width, i, gs.g[i].klen)
            k += 1
    PyMem_Free(gs.g)
    PyMem_Free(gs.keys)
    PyMem_Free(gs.table)
    gs.g, gs.keys, gs.table, gs.mask = g, keys, table, slots - 1
    gs.width, gs.cap, gs.n, gs.live = width, cap, k, k
    for i in range(k):
        ghost_table_put(gs, <int32_t>i)
    return 0


cdef int ghost_add(Ghosts* gs, const char* kp, Py_ssize_t klen, Py_hash_t h, int seg) except -1:
    """`evicted[key] = seg`: a ghost already there keeps its place and takes the new segment."""
    cdef Py_ssize_t i = ghost_find(gs, kp, klen, h)
    cdef char* copy = NULL
    if i >= 0:
        gs.g[i].seg = <uint8_t>seg
        return 0
    if gs.n == gs.cap or slot_width(klen) > gs.width:  # full (maybe of dead entries), or a wider slot
        # compacted in place while at most half are live, else twice the room
        ghost_layout(gs, max(16, 2 * gs.cap) if gs.n == gs.cap and 2 * gs.live >= gs.cap else gs.cap,
                     max(slot_width(klen), gs.width), 0)
    if klen > INLINE_KEY:
        copy = long_copy(kp, klen)
    i = gs.n
    gs.g[i].hash, gs.g[i].klen, gs.g[i].seg, gs.g[i].alive = h, <uint16_t>klen, <uint8_t>seg, 1
    slot_fill(gs.keys, gs.width, i, kp, klen, copy)
    ghost_table_put(gs, <int32_t>i)
    gs.n += 1
    gs.live += 1
    return 0


cdef int ghost_pop(Ghosts* gs, const char* kp, Py_ssize_t klen, Py_hash_t h) noexcept nogil:
    """`evicted.pop(key)`: the segment it was evicted from, or -1."""
    cdef Py_ssize_t i
    if gs.live == 0:
        return -1
    i = ghost_find(gs, kp, klen, h)
    if i < 0:
        return -1
    ghost_table_del(gs, <int32_t>i)
    slot_free(gs.keys, gs.width, i, gs.g[i].klen)
    gs.g[i].alive = 0
    gs.live -= 1
    return gs.g[i].seg


cdef int ghost_trim(Ghosts* gs, Py_ssize_t limit) except -1:
    """`GhostList.trim`: once there are 2x `limit` ghosts, keep the newest `limit`."""
    cdef Py_ssize_t i, kept = 0
    if gs.live < 2 * limit:
        return 0
    i = gs.n  # back from the newest to the oldest of the `limit` kept (limit 0: none)
    while kept < limit:
        i -= 1
        if gs.g[i].alive:
            kept += 1
    ghost_layout(gs, max(16, 2 * limit + 16), gs.width, i)
    return 0


cdef void ghost_free_keys(Ghosts* gs) noexcept nogil:
    """Free the long keys of the live ghosts (all of them are about to be forgotten)."""
    cdef Py_ssize_t i
    for i in range(gs.n):
        if gs.g[i].alive:
            slot_free(gs.keys, gs.width, i, gs.g[i].klen)


cdef void ghost_clear(Ghosts* gs) noexcept nogil:
    ghost_free_keys(gs)
    gs.n, gs.live = 0, 0
    if gs.table != NULL:
        memset(gs.table, 0xff, (gs.mask + 1) * sizeof(int32_t))


cdef void ghost_free(Ghosts* gs) noexcept:
    ghost_free_keys(gs)
    PyMem_Free(gs.g)
    PyMem_Free(gs.keys)
    PyMem_Free(gs.table)


cdef dict ghost_dict(Ghosts* gs):
    """The ghosts as `GhostList.evicted` holds them: key -> segment, oldest first."""
    cdef Py_ssize_t i
    return {PyBytes_FromStringAndSize(ghost_key(gs, i), gs.g[i].klen): gs.g[i].seg
            for i in range(gs.n) if gs.g[i].alive}
