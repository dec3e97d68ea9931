# The block views of a compiled index (included by _compact_lru_index.pxi and
# _compact_prefix_index.pxi, ahead of each module's `Index`, whose `c` is its `Core`).

cdef class Index


@cython.final
@cython.freelist(256)
cdef class BlockView:
    """A resident block of an `Index` (what `get` returns), or an evicted one (detached, what
    `evict` returns). `ref_cnt` reads and writes the index's entry; `block_id` is fixed. Used
    after its block left, it raises LookupError (checked by key and block id)."""

    cdef Index owner  # None: detached
    cdef object key
    cdef int32_t idx
    cdef int32_t detached_ref
    cdef readonly int64_t block_id

    cdef Entry* entry(self) except NULL:
        cdef Core* c = &self.owner.c
        cdef Entry* e = &c.e[self.idx]
        if (not e.flags & USED or e.block_id != self.block_id or e.klen != PyBytes_GET_SIZE(self.key)
                or memcmp(key_at(c, self.idx), PyBytes_AS_STRING(self.key), e.klen) != 0):
            raise LookupError(f"{POLICY_NAME}: block {self.block_id} of key {self.key!r} is no longer resident; "
                              "a view from get() is valid only while its block stays resident (pinned)")
        return e

    @property
    def ref_cnt(self):
        return self.detached_ref if self.owner is None else self.entry().ref_cnt

    @ref_cnt.setter
    def ref_cnt(self, int32_t value):
        if self.owner is None:
            self.detached_ref = value
        else:
            self.entry().ref_cnt = value

    @property
    def is_ready(self):
        """Whether the block can be read."""
        return self.ref_cnt >= 0

    def __repr__(self):
        return f"BlockView(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


cdef inline BlockView view_of(Index owner, int32_t i, object key):
    cdef BlockView v = BlockView.__new__(BlockView)
    v.owner, v.idx, v.key, v.block_id = owner, i, key, owner.c.e[i].block_id
    return v


cdef inline BlockView detached(Entry* e):
    """A view of an entry about to leave: its block id and ref_cnt, kept in the view."""
    cdef BlockView v = BlockView.__new__(BlockView)
    v.block_id, v.detached_ref = e.block_id, e.ref_cnt
    return v
