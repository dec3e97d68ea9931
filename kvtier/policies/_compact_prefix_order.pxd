# The eviction order of the compiled prefix-freq (kvtier/policies/_compact_prefix_order.pyx):
# its records, segments, aside queues and the eviction walk, over the entries of the compiled block
# table it is composed into (kvtier/index/_table.pxd). Cimported by kvtier/policies/_compact_prefix.pyx.

from libc.stdint cimport int32_t, int64_t, uint8_t

from kvtier.index._table cimport Chain, Links, Table, chain_append, chain_remove


cdef enum:
    ASIDE = 4  # out of its segment's list (a flag bit the table leaves to the policy)
    MAX_SEGS = 16
    TAIL = 0  # segment of request tails; segment 1 + c holds the blocks with c hits

ctypedef struct Rec:  # entry i's place in the order: the table's record i (its segment: Entry.spare)
    Links l  # its segment's list
    double stamp  # the clock at its last use
    int64_t seq  # while aside: when it was set aside

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
    Table* t  # the table the order is composed into
    int nsegs
    int64_t seq
    Chain seg[MAX_SEGS]
    FreedList freed[MAX_SEGS]

ctypedef struct IdxVec:  # a growable array of entries
    int32_t* v
    Py_ssize_t n
    Py_ssize_t cap


cdef inline Rec* rec(Core* c, int32_t i) noexcept nogil:
    return (<Rec*>c.t.rec) + i


cdef inline void unlink(Core* c, int32_t i) noexcept nogil:
    chain_remove(c.t, &c.seg[c.t.e[i].spare], i)


cdef inline void place(Core* c, int32_t i, int seg, double stamp) noexcept nogil:
    """Entry i at the end of segment `seg`'s list with this stamp."""
    c.t.e[i].spare = <uint8_t>seg
    rec(c, i).stamp = stamp
    chain_append(c.t, &c.seg[seg], i)


cdef int push_freed(Core* c, int32_t i) except -1
cdef int set_aside(Core* c, int32_t i) except -1
cdef void leave(Core* c, int32_t i) noexcept nogil
cdef void order_clear(Core* c) noexcept nogil
cdef void order_free(Core* c) noexcept
cdef size_t order_bytes(Core* c) noexcept nogil
cdef Py_ssize_t walk(Core* c, Py_ssize_t n, int32_t* out, bint tails_first, const double* offsets,
                     IdxVec* met) except -1
