# The Python-visible side of the compiled block table (kvtier/index/_table_api.pyx): the base
# class of the compiled policy indexes and the block views their `get` returns.

from libc.stdint cimport int32_t, int64_t

from kvtier.index._table cimport Entry, Table


cdef class CompactTable:
    cdef Table* tp  # the table inside the policy's state (set by the policy's __cinit__)
    cdef bint tracking  # evictable accounting on (the first `evictable` notice)
    cdef bint tails  # the insert calls name the request's tail to `put`

    cdef int32_t put(self, object key, int64_t block_id, int32_t ref_cnt, bint tail) except -1
    cdef int unpinned(self, int32_t i) except -1
    cdef int unpin_entry(self, int32_t i) except -1
    cdef Py_ssize_t pick(self, Py_ssize_t n, object protected, int32_t* chosen) except -1
    cdef int drop_victims(self, int32_t* chosen, Py_ssize_t n) except -1
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
