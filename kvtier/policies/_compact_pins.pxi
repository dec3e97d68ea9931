# Evictable accounting (`CachePolicy.track_pins`) and protected marks over a `Core`, shared by
# the compiled indexes (included by _compact_lru.pyx and _compact_prefix.pyx after their
# `unpin_entry`, which also queues an aside entry the index's own way): an entry's PINNED flag
# and the count `npinned`, so that a refusal is known in O(len(protected)).


cdef inline void pin_entry(Core* c, int32_t i) noexcept nogil:
    """Entry i is not evictable any more (`pin`, evictable accounting)."""
    if not c.e[i].flags & PINNED:
        c.e[i].flags |= PINNED
        c.npinned += 1


cdef void pin_by_ref_cnt(Core* c) noexcept nogil:
    """`track_pins`: the resident entries whose ref_cnt is not 0 are the pinned ones."""
    cdef int32_t i
    c.npinned = 0
    for i in range(c.hw):
        if c.e[i].flags & USED:
            c.e[i].flags &= ~PINNED
            if c.e[i].ref_cnt != 0:
                pin_entry(c, i)


cdef int pin_keys(Core* c, object keys) except -1:
    cdef int32_t i
    for key in keys:
        i = locate_in(c, key)
        if i >= 0:
            pin_entry(c, i)
    return 0


cdef int unpin_keys(Core* c, object keys) except -1:
    cdef int32_t i
    for key in keys:
        i = locate_in(c, key)
        if i >= 0:
            unpin_entry(c, i)
    return 0


cdef set pinned_set(Core* c):
    """The resident keys counted as pinned (a new set)."""
    cdef int32_t i
    return {key_in(c, i) for i in range(c.hw) if c.e[i].flags & USED and c.e[i].flags & PINNED}


cdef Py_ssize_t evictable_in(Core* c, object protected) except -1:
    """`CachePolicy.evictable_count`: resident, unpinned entries not in `protected`."""
    cdef int32_t i
    cdef Py_ssize_t free = c.count - c.npinned
    for key in protected:
        i = locate_in(c, key)
        if i >= 0 and not c.e[i].flags & PINNED:
            free -= 1
    return free


cdef bint refuses_in(Core* c, Py_ssize_t n, object protected) except -1:
    """`CachePolicy._refuses` with pins tracked: fewer than n evictable, unprotected entries."""
    if c.count - c.npinned >= n + len(protected):
        return False
    return evictable_in(c, protected) < n


cdef list mark_keys(Core* c, object keys):
    """Mark the resident entries of `keys` (`protected` during one walk); the entries marked."""
    cdef int32_t i
    marked = []
    for key in keys:
        i = locate_in(c, key)
        if i >= 0 and not c.e[i].flags & MARK:
            c.e[i].flags |= MARK
            marked.append(i)
    return marked


cdef void unmark_keys(Core* c, list marked):
    cdef int32_t i
    for i in marked:
        c.e[i].flags &= ~MARK
