# Key slots of the compiled indexes (included by _compact_table.pxi, used by it and by
# _compact_ghosts.pxi): a key of up to INLINE_KEY bytes sits inline in its entry's slot of a key
# array whose width is the longest such key seen (36 bytes for vLLM's keys); a longer key gets an
# allocation of its own and the slot holds its address. So one long key costs its own length, not
# capacity x its length, and the width never exceeds INLINE_KEY. Whoever owns a slot frees its
# long key (`slot_free`) when the slot's key is forgotten.

from libc.stdlib cimport free, malloc

cdef enum:
    INLINE_KEY = 64  # longer keys live outside the key array


cdef inline Py_ssize_t slot_width(Py_ssize_t klen) noexcept nogil:
    """Bytes a key of `klen` bytes takes in its slot: itself, or the address of its allocation."""
    return klen if klen <= INLINE_KEY else <Py_ssize_t>sizeof(char*)


cdef inline char* slot_at(char* keys, Py_ssize_t width, Py_ssize_t i) noexcept nogil:
    return keys + i * width


cdef inline char* slot_address(char* keys, Py_ssize_t width, Py_ssize_t i) noexcept nogil:
    """The address a long key's slot holds. Copied out with memcpy: a slot of a key array
    `width` bytes wide (36 for vLLM's keys) is not aligned for a pointer."""
    cdef char* p
    memcpy(&p, slot_at(keys, width, i), sizeof(char*))
    return p


cdef inline char* slot_key(char* keys, Py_ssize_t width, Py_ssize_t i, Py_ssize_t klen) noexcept nogil:
    """The bytes of the key of `klen` bytes in slot i."""
    if klen <= INLINE_KEY:
        return slot_at(keys, width, i)
    return slot_address(keys, width, i)


cdef char* long_copy(const char* kp, Py_ssize_t klen) except NULL:
    """A key longer than INLINE_KEY copied into an allocation of its own (for `slot_fill`)."""
    cdef char* p = <char*>malloc(klen)
    if p == NULL:
        raise MemoryError()
    memcpy(p, kp, klen)
    return p


cdef inline void slot_fill(char* keys, Py_ssize_t width, Py_ssize_t i, const char* kp, Py_ssize_t klen,
                           char* copy) noexcept nogil:
    """Put a key in slot i: inline, or the address of its `long_copy` (made beforehand, so that
    nothing can fail once an entry is taken)."""
    if klen <= INLINE_KEY:
        memcpy(slot_at(keys, width, i), kp, klen)
    else:
        memcpy(slot_at(keys, width, i), &copy, sizeof(char*))  # (unaligned: see slot_address)


cdef inline void slot_move(char* dst, Py_ssize_t dst_width, Py_ssize_t k, char* src, Py_ssize_t src_width,
                           Py_ssize_t i, Py_ssize_t klen) noexcept nogil:
    """Slot i of `src` to slot k of `dst` (a long key's allocation changes owner, not place)."""
    memcpy(slot_at(dst, dst_width, k), slot_at(src, src_width, i), slot_width(klen))


cdef inline void slot_free(char* keys, Py_ssize_t width, Py_ssize_t i, Py_ssize_t klen) noexcept nogil:
    """Free the allocation of slot i's key, if it is a long one."""
    if klen > INLINE_KEY:
        free(slot_address(keys, width, i))
