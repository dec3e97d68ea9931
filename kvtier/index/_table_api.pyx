# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The Python-visible side of the compiled block table (kvtier/index/_table.pyx): `CompactTable`,
the base class of the compiled policy indexes, and `BlockView`, what their `get` returns.

`CompactTable` answers everything that is the table's, not the policy's: `get` and `len`, the
evictable accounting (`evictable`, `pinned_keys`, `evictable_count`), the insert calls and the
request cycle's batch calls (`kvtier.index.BlockTable`), each one C loop
over the table with the answers and side effects of `CachePolicy`'s key-by-key defaults. A
policy's index class derives from it, points `tp` at the `Table` inside its own state and says
how it takes an entry in (`put`), picks victims (`pick`) and removes them (`drop_victims`), and
requeues an entry that became evictable (`unpinned`).
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcmp

from kvtier.index._table cimport (
    PINNED, USED, Entry, Table, evictable_in, entries_of, forget_pin, key_at, key_in, locate_in,
    pin_by_ref_cnt, pin_entry, refuses_in,
)


cdef class CompactTable:
    """The block table part of a compiled policy index (the base of its class; not made on its
    own): `get` and `len`, the evictable accounting (`evictable`, `evictable_count`, ...), the
    insert calls and the request cycle's batch calls (`kvtier.index.BlockTable`), each one C
    loop with the answers and side effects of `CachePolicy`'s key-by-key defaults. The policy
    sets `tp` in its `__cinit__` and implements `put`, `pick`, `drop_victims` and `unpinned`."""

    def __cinit__(self, *args, **kwargs):
        if type(self) is CompactTable:
            raise TypeError("CompactTable is the base of a compiled policy index, not made on its own")

    cdef int32_t put(self, object key, int64_t block_id, int32_t ref_cnt, bint tail) except -1:
        """Enter a block, or overwrite a resident one's values (its place kept); its entry.
        `tail`: it is the request's last new block (only when `tails` is set)."""
        raise NotImplementedError

    cdef Py_ssize_t pick(self, Py_ssize_t n, object protected, int32_t* chosen) except -1:
        """Choose `evict(n, protected)`'s victims (0 < n <= count) into `chosen`, in order: n, or
        0 when it refuses (the order may be rearranged, no entry leaves)."""
        raise NotImplementedError

    cdef int drop_victims(self, int32_t* chosen, Py_ssize_t n) except -1:
        """Remove the n entries `pick` chose (their keys and values were read)."""
        raise NotImplementedError

    cdef object take(self, Py_ssize_t n, object protected, bint ids):
        """`evict(n, protected)` (n > 0): the victims in order as (key, detached view) pairs, or
        with `ids` as (keys, block ids); None (nothing left) when there are not n."""
        cdef Table* t = self.tp
        cdef int32_t* chosen
        cdef Py_ssize_t j
        if n > t.count or (self.tracking and refuses_in(t, n, protected)):
            return None
        chosen = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        if chosen == NULL:
            raise MemoryError()
        try:
            if self.pick(n, protected, chosen) == 0:
                return None
            keys = [key_in(t, chosen[j]) for j in range(n)]
            out = (keys, [t.e[chosen[j]].block_id for j in range(n)]) if ids else [
                (keys[j], detached(&t.e[chosen[j]])) for j in range(n)]
            self.drop_victims(chosen, n)
            return out
        finally:
            PyMem_Free(chosen)

    cdef int unpinned(self, int32_t i) except -1:
        """Entry i became evictable and is no longer counted as pinned (the policy may requeue it)."""
        return 0

    cdef int unpin_entry(self, int32_t i) except -1:
        forget_pin(self.tp, i)
        return self.unpinned(i)

    # ------------------------------------------------------------------ vLLM's CachePolicy calls
    def get(self, key):
        cdef int32_t i = locate_in(self.tp, key)
        return None if i < 0 else view_of(self, i, key)

    def __len__(self):
        return self.tp.count

    def insert(self, key, block):
        """Copy `block.block_id` and `block.ref_cnt` into a new entry (`block` is not kept)."""
        self.put(key, block.block_id, block.ref_cnt, False)

    def insert_many(self, keys, blocks, tail=None):
        cdef bint is_tail
        if not self.tails:
            tail = None
        for key, block in zip(keys, blocks):
            is_tail = tail is not None and key == tail
            if is_tail:
                tail = None
            self.put(key, block.block_id, block.ref_cnt, is_tail)

    def evict(self, Py_ssize_t n, protected):
        return [] if n <= 0 else self.take(n, protected, False)

    # ------------------------------------------------------------------ evictable accounting
    def evictable(self, keys, bint flag):
        """`CachePolicy.evictable`: the first notice starts the accounting (entries resident then
        with ref_cnt != 0 count as pinned); then `keys` stop (False) or start (True) being evictable."""
        cdef int32_t i
        if not self.tracking:
            self.tracking = True
            pin_by_ref_cnt(self.tp)
        for key in keys:
            i = locate_in(self.tp, key)
            if i >= 0:
                if flag:
                    self.unpin_entry(i)
                else:
                    pin_entry(self.tp, i)

    def pinned_keys(self):
        """The resident keys counted as pinned (a new set), or None when pins are not tracked."""
        cdef Table* t = self.tp
        cdef int32_t i
        if not self.tracking:
            return None
        return {key_in(t, i) for i in range(t.hw) if t.e[i].flags & USED and t.e[i].flags & PINNED}

    def evictable_count(self, protected=()):
        return evictable_in(self.tp, protected) if self.tracking else None

    # ------------------------------------------------------------------ the request cycle
    def readable_run(self, keys):
        cdef Py_ssize_t n = 0
        cdef int32_t i
        for key in keys:
            i = locate_in(self.tp, key)
            if i < 0 or self.tp.e[i].ref_cnt < 0:
                break
            n += 1
        return n

    def absent(self, keys):
        return [key for key in keys if locate_in(self.tp, key) < 0]

    def insert_written(self, keys, block_ids, tail=None):
        cdef Py_ssize_t j, n = len(keys)
        cdef bint is_tail
        cdef int32_t i
        if len(block_ids) != n:
            raise ValueError(f"insert_written: {n} keys but {len(block_ids)} block ids")
        if not self.tails:
            tail = None
        for j in range(n):
            key = keys[j]
            is_tail = tail is not None and key == tail
            if is_tail:
                tail = None
            i = self.put(key, block_ids[j], -1, is_tail)
            if self.tracking:
                pin_entry(self.tp, i)

    def pin_loads(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t n = len(ks), j
        cdef int32_t* idx = entries_of(self.tp, ks, False)
        cdef Entry* e
        try:
            for j in range(n):
                if idx[j] < 0 or self.tp.e[idx[j]].ref_cnt < 0:
                    return None
            ids = [None] * n
            for j in range(n):
                e = &self.tp.e[idx[j]]
                e.ref_cnt += 1
                if self.tracking:
                    pin_entry(self.tp, idx[j])
                ids[j] = e.block_id
            return ids
        finally:
            PyMem_Free(idx)

    def release_loads(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t j
        cdef int32_t* idx = entries_of(self.tp, ks, True)
        try:
            for j in range(len(ks)):
                self.tp.e[idx[j]].ref_cnt -= 1
                if self.tracking and self.tp.e[idx[j]].ref_cnt == 0:
                    self.unpin_entry(idx[j])
        finally:
            PyMem_Free(idx)

    def mark_written(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t n = len(ks), j, k
        cdef int32_t* idx = entries_of(self.tp, ks, False)
        try:
            for j in range(n):
                if idx[j] < 0 or self.tp.e[idx[j]].ref_cnt != -1:  # (a key given twice: 0 at its second place)
                    for k in range(j):
                        self.tp.e[idx[k]].ref_cnt = -1
                    return False
                self.tp.e[idx[j]].ref_cnt = 0
            if self.tracking:
                for j in range(n):
                    self.unpin_entry(idx[j])
            return True
        finally:
            PyMem_Free(idx)

    def evict_ids(self, Py_ssize_t n, protected):
        return ([], []) if n <= 0 else self.take(n, protected, True)

    def insert_ready(self, keys, block_ids):
        cdef Py_ssize_t j, n = len(keys)
        if len(block_ids) != n:
            raise ValueError(f"insert_ready: {n} keys but {len(block_ids)} block ids")
        for j in range(n):
            self.put(keys[j], block_ids[j], 0, False)

    def forget(self, keys):
        for key in keys:
            self.remove(key)


@cython.final
@cython.freelist(256)
cdef class BlockView:
    """A resident block of a compiled index (what `get` returns), or an evicted one (detached,
    what `evict` returns). `ref_cnt` reads and writes the index's entry; `block_id` is fixed.
    Used after its block left, it raises LookupError (checked by key and block id)."""

    cdef Entry* entry(self) except NULL:
        cdef Table* t = self.owner.tp
        cdef Entry* e = &t.e[self.idx]
        if (not e.flags & USED or e.block_id != self.block_id or e.klen != PyBytes_GET_SIZE(self.key)
                or memcmp(key_at(t, self.idx), PyBytes_AS_STRING(self.key), e.klen) != 0):
            raise LookupError(f"{t.label.decode()}: block {self.block_id} of key {self.key!r} is no longer "
                              "resident; a view from get() is valid only while its block stays resident (pinned)")
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


cdef BlockView view_of(CompactTable owner, int32_t i, object key):
    cdef BlockView v = BlockView.__new__(BlockView)
    v.owner, v.idx, v.key, v.block_id = owner, i, key, owner.tp.e[i].block_id
    return v


cdef BlockView detached(Entry* e):
    """A view of an entry about to leave: its block id and ref_cnt, kept in the view."""
    cdef BlockView v = BlockView.__new__(BlockView)
    v.block_id, v.detached_ref = e.block_id, e.ref_cnt
    return v
