# The block-table calls of the request cycle (`kvtier.index.BlockTable`) as C loops over a `Core`, shared
# by the compiled indexes (included by _compact_lru.pyx and _compact_prefix.pyx after
# _compact_pins.pxi): the answers and side effects of `CachePolicy`'s key-by-key defaults.


cdef Py_ssize_t readable_run_in(Core* c, object keys) except -1:
    cdef Py_ssize_t n = 0
    cdef int32_t i
    for key in keys:
        i = locate_in(c, key)
        if i < 0 or c.e[i].ref_cnt < 0:
            break
        n += 1
    return n


cdef list absent_in(Core* c, object keys):
    return [key for key in keys if locate_in(c, key) < 0]


cdef object pin_loads_in(Core* c, object keys, bint tracking):
    cdef list ks = keys if type(keys) is list else list(keys)
    cdef Py_ssize_t n = len(ks), j
    cdef int32_t* idx = entries_of(c, ks, False)
    cdef Entry* e
    cdef list ids
    try:
        for j in range(n):
            if idx[j] < 0 or c.e[idx[j]].ref_cnt < 0:
                return None
        ids = [None] * n
        for j in range(n):
            e = &c.e[idx[j]]
            e.ref_cnt += 1
            if tracking:
                pin_entry(c, idx[j])
            ids[j] = e.block_id
        return ids
    finally:
        PyMem_Free(idx)


cdef int release_loads_in(Core* c, object keys, bint tracking) except -1:
    cdef list ks = keys if type(keys) is list else list(keys)
    cdef Py_ssize_t j
    cdef int32_t* idx = entries_of(c, ks, True)
    try:
        for j in range(len(ks)):
            c.e[idx[j]].ref_cnt -= 1
            if tracking and c.e[idx[j]].ref_cnt == 0:
                unpin_entry(c, idx[j])
    finally:
        PyMem_Free(idx)
    return 0


cdef bint mark_written_in(Core* c, object keys, bint tracking) except -1:
    cdef list ks = keys if type(keys) is list else list(keys)
    cdef Py_ssize_t n = len(ks), j, k
    cdef int32_t* idx = entries_of(c, ks, False)
    try:
        for j in range(n):
            if idx[j] < 0 or c.e[idx[j]].ref_cnt != -1:  # (a key given twice: 0 at its second place)
                for k in range(j):
                    c.e[idx[k]].ref_cnt = -1
                return False
            c.e[idx[j]].ref_cnt = 0
        if tracking:
            for j in range(n):
                unpin_entry(c, idx[j])
        return True
    finally:
        PyMem_Free(idx)
