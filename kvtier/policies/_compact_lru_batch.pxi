# The block-table calls of the request cycle (`kvtier.index.BlockTable`), included by _compact_lru.pyx:
# one C loop per batch over the index (_compact_batch_ops.pxi), no view per block.


cdef class CompactLRUBatch(Index):
    """`Index` with the batch calls `CachePolicy` documents (`readable_run`,
    `absent`, `pin_loads`, `release_loads`, `mark_written`): the same answers and side
    effects as its defaults there, which go key by key through `get`, `pin` and `unpin`."""

    def readable_run(self, keys):
        return readable_run_in(&self.c, keys)

    def absent(self, keys):
        return absent_in(&self.c, keys)

    def insert_written(self, keys, block_ids, tail=None):
        cdef Py_ssize_t j, n = len(keys)
        cdef int32_t i
        if len(block_ids) != n:
            raise ValueError(f"insert_written: {n} keys but {len(block_ids)} block ids")
        for j in range(n):
            i = self.put(keys[j], block_ids[j], -1)
            if self.tracking:
                pin_entry(&self.c, i)

    def pin_loads(self, keys):
        return pin_loads_in(&self.c, keys, self.tracking)

    def release_loads(self, keys):
        release_loads_in(&self.c, keys, self.tracking)

    def mark_written(self, keys):
        return mark_written_in(&self.c, keys, self.tracking)

    def evict_ids(self, Py_ssize_t n, protected):
        return ([], []) if n <= 0 else self.take(n, protected, True)
