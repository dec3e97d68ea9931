# The Python-visible side of the compiled block table (kvtier/index/_table_api.pyx): the table
# (`CompactTable`), the base of the eviction orders composed into it (`CompactOrder`), and the
# block views its `get` returns.

from libc.stdint cimport int32_t, int64_t

from kvtier.index._table cimport Entry, Table


cdef class CompactOrder:
    cdef Table* t  # the table this order is composed into (set once, by that table)
    cdef size_t rec_size  # bytes of this order's record per entry (set by its __cinit__)
    cdef const char* label  # the policy's name, for messages (a C literal)
    cdef bint tails  # the table names a request's tail to `entered`

    cdef int attached(self) except -1
    cdef int entered(self, int32_t i, bint tail) except -1
    cdef int leaving(self, int32_t i) except -1
    cdef int unpinned(self, int32_t i) except -1
    cdef int touched(self, list keys) except -1
    cdef Py_ssize_t pick(self, Py_ssize_t n, int32_t* chosen) except -1
    cdef int evicting(self, int32_t* chosen, Py_ssize_t n) except -1
    cdef int evicted(self) except -1
    cdef int cleared(self) except -1


cdef class CompactTable:
    cdef Table t
    cdef readonly CompactOrder order

    cdef int32_t put(self, object key, int64_t block_id, int32_t ref_cnt, bint tail) except -1
    cdef int unpin_entry(self, int32_t i) except -1
    cdef int drop_entry(self, int32_t i) except -1
    cdef object take(self, Py_ssize_t n, object protected, bint ids)


cdef class BlockView:
    cdef CompactTable owner  # None: detached
    cdef object key
    cdef int32_t idx
    cdef int32_t detached_ref
    cdef readonly int64_t block_id

    cdef Entry* entry(self) except NULL


cdef BlockView view_of(CompactTable owner, int32_t i, object key)
cdef BlockView detached(Entry* e)
