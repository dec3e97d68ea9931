# The batch calls of the request cycle (`CachePolicy.batch_calls`), included by _compact_lru.pyx:
# one C loop per batch over the index, no view per block.


cdef class CompactLRUBatch(CompactLRUIndex):
    """`CompactLRUIndex` with the batch calls `CachePolicy` documents (`readable_run`,
    `absent`, `pin_loads`, `release_loads`, `mark_written`): the same answers and side
    effects as its defaults there, which go key by key through `get`, `pin` and `unpin`."""

    cdef int32_t* slots(self, list keys, bint resident) except NULL:
        """The entries of `keys` (PyMem_Malloc'd, for the caller to free); -1 for a key not
        resident. With `resident`, NULL-free only when all are: raises KeyError otherwise."""
        cdef Py_ssize_t n = len(keys), j
        cdef int32_t* idx = <int32_t*>PyMem_Malloc(max(n, 1) * sizeof(int32_t))
        if idx == NULL:
            raise MemoryError()
        for j in range(n):
            idx[j] = self.locate(keys[j])
            if resident and idx[j] < 0:
                PyMem_Free(idx)
                raise KeyError(keys[j])
        return idx

    def readable_run(self, keys):
        cdef Py_ssize_t n = 0
        cdef int32_t i
        for key in keys:
            i = self.locate(key)
            if i < 0 or self.c.e[i].ref_cnt < 0:
                break
            n += 1
        return n

    def absent(self, keys):
        return [key for key in keys if self.locate(key) < 0]

    def insert_written(self, keys, block_ids, tail=None):
        cdef Py_ssize_t j, n = len(keys)
        cdef int32_t i
        if len(block_ids) != n:
            raise ValueError(f"insert_written: {n} keys but {len(block_ids)} block ids")
        for j in range(n):
            i = self.put(keys[j], block_ids[j], -1)
            if self.tracking and not self.c.e[i].flags & PINNED:
                self.c.e[i].flags |= PINNED
                self.c.npinned += 1

    def pin_loads(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t n = len(ks), j
        cdef int32_t* idx = self.slots(ks, False)
        cdef Entry* e
        cdef list ids
        try:
            for j in range(n):
                if idx[j] < 0 or self.c.e[idx[j]].ref_cnt < 0:
                    return None
            ids = [None] * n
            for j in range(n):
                e = &self.c.e[idx[j]]
                e.ref_cnt += 1
                if self.tracking and not e.flags & PINNED:
                    e.flags |= PINNED
                    self.c.npinned += 1
                ids[j] = e.block_id
            return ids
        finally:
            PyMem_Free(idx)

    def release_loads(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t j
        cdef int32_t* idx = self.slots(ks, True)
        try:
            for j in range(len(ks)):
                self.c.e[idx[j]].ref_cnt -= 1
                if self.tracking and self.c.e[idx[j]].ref_cnt == 0:
                    unpin_entry(&self.c, idx[j])
        finally:
            PyMem_Free(idx)

    def mark_written(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t n = len(ks), j, k
        cdef int32_t* idx = self.slots(ks, False)
        try:
            for j in range(n):
                if idx[j] < 0 or self.c.e[idx[j]].ref_cnt != -1:  # (a key given twice: 0 at its second place)
                    for k in range(j):
                        self.c.e[idx[k]].ref_cnt = -1
                    return False
                self.c.e[idx[j]].ref_cnt = 0
            if self.tracking:
                for j in range(n):
                    unpin_entry(&self.c, idx[j])
            return True
        finally:
            PyMem_Free(idx)

    def evict_ids(self, Py_ssize_t n, protected):
        cdef Core* c = &self.c
        cdef int32_t* chosen
        cdef Py_ssize_t got, j
        cdef int32_t i
        if n <= 0:
            return [], []
        if n > c.count or (self.tracking and self._refuses(n, protected)):
            return None
        chosen = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        if chosen == NULL:
            raise MemoryError()
        try:
            got = self.pick(n, protected, chosen)
            if got == 0:
                return None
            keys, ids = [None] * got, [None] * got
            for j in range(got):
                i = chosen[j]
                keys[j] = self.key_of(i)
                ids[j] = c.e[i].block_id
                drop(c, i)
            return keys, ids
        finally:
            PyMem_Free(chosen)
