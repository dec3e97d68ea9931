# The ghost list of the compiled prefix-freq (kvtier/policies/_compact_prefix_ghosts.pyx): its
# layout and calls, cimported by kvtier/policies/_compact_prefix.pyx.

from libc.stdint cimport int32_t, uint8_t, uint16_t


ctypedef struct Ghost:
    Py_hash_t hash
    uint16_t klen
    uint8_t seg
    uint8_t alive

ctypedef struct Ghosts:
    Ghost* g  # appended in eviction order, dead ones among them
    char* keys  # `width` bytes per entry
    Py_ssize_t width
    Py_ssize_t n  # entries used
    Py_ssize_t cap  # entries allocated
    Py_ssize_t live
    int32_t* table  # -1: empty
    size_t mask


cdef int ghost_add(Ghosts* gs, const char* kp, Py_ssize_t klen, Py_hash_t h, int seg) except -1
cdef int ghost_pop(Ghosts* gs, const char* kp, Py_ssize_t klen, Py_hash_t h) noexcept nogil
cdef int ghost_trim(Ghosts* gs, Py_ssize_t limit) except -1
cdef void ghost_clear(Ghosts* gs) noexcept nogil
cdef void ghost_free(Ghosts* gs) noexcept
cdef dict ghost_dict(Ghosts* gs)
