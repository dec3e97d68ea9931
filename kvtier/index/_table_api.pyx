# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The Python-visible side of the compiled block table (kvtier/index/_table.pyx): `CompactTable`,
the table itself, composed with one eviction order (`CompactOrder`: the compiled `lru` and
`prefix-freq` orders derive from it), and `BlockView`, what its `get` returns.

`CompactTable` is the only writer of a block's entry: key, slot, ref_cnt, pins and the evictable
count. It answers `kvtier.index.BlockTable` and vLLM's `CachePolicy` calls (`get`, `insert`,
`remove`, `touch`, `evict`, ...), each one C loop. The order keeps its records and lists and is
told, through C-level hooks, when an entry comes in (`entered`), is about to leave (`leaving`,
`evicting`), becomes evictable again (`unpinned`) or is used (`touched`); it chooses victims
(`pick`, with the `protected` entries marked by the table) and names them (`victims`).
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcmp

from kvtier.index._table cimport (
    HELD, PINNED, USED, Entry, Table, claim, evictable_in, entries_of, forget_all, forget_pin, key_at, key_in,
    locate_in, mark_keys, pin_by_ref_cnt, pin_entry, refuses_in, release, table_bytes, table_free,
    table_init, unmark_keys,
)


cdef class CompactOrder:
    """An eviction order over a compiled table's entries (the base of the compiled orders; not
    made on its own). Composed into one `CompactTable`, which sets `t` and calls the hooks; the
    order writes only its records, its lists and the flag bits the table leaves to it."""

    def __cinit__(self, *args, **kwargs):
        if type(self) is CompactOrder:
            raise TypeError("CompactOrder is the base of a compiled eviction order, not made on its own")

    cdef int attached(self) except -1:
        """Composed into the table `t` (its arrays made, empty)."""
        return 0

    cdef int entered(self, int32_t i, bint tail) except -1:
        """Entry i is new in the table (claimed, record untouched): place it. `tail`: it is the
        request's last new block (only when `tails` is set)."""
        raise NotImplementedError

    cdef int leaving(self, int32_t i) except -1:
        """Entry i leaves without being evicted (`remove`, `forget`): unlink it (the table
        releases it next)."""
        raise NotImplementedError

    cdef int unpinned(self, int32_t i) except -1:
        """Entry i became evictable and is no longer counted as pinned (it may be requeued)."""
        return 0

    cdef int touched(self, list keys) except -1:
        """`touch(keys)` (`CachePolicy.touch`)."""
        raise NotImplementedError

    cdef Py_ssize_t pick(self, Py_ssize_t n, int32_t* chosen) except -1:
        """Choose `evict(n, protected)`'s victims (0 < n <= count; the protected entries carry
        MARK) into `chosen`, in order: n, or 0 when it refuses (the order may be rearranged)."""
        raise NotImplementedError

    cdef int evicting(self, int32_t* chosen, Py_ssize_t n) except -1:
        """The n entries `pick` chose are evicted (their keys are still readable): unlink them,
        record what the order keeps of them; the table releases them next."""
        raise NotImplementedError

    cdef int evicted(self) except -1:
        """The victims were released (the order may rearrange the entries `pick` passed over)."""
        return 0

    cdef int cleared(self) except -1:
        """The table forgot every entry (`clear`): empty every list."""
        raise NotImplementedError


cdef class CompactTable:
    """The compiled block table composed with `order` (see the module docstring). Keys are bytes
    of at most 65535 bytes; at most `cache_capacity` blocks before the arrays grow past it."""

    def __cinit__(self, cache_capacity, CompactOrder order not None):
        if order.t != NULL:
            raise ValueError("this eviction order already belongs to a table")
        table_init(&self.t, cache_capacity, order.rec_size, order.label)
        self.order = order
        order.t = &self.t
        order.attached()

    def __dealloc__(self):
        if self.order is not None:
            self.order.t = NULL
        table_free(&self.t)

    cdef int32_t put(self, object key, int64_t block_id, int32_t ref_cnt, bint tail) except -1:
        """Enter a block, or overwrite a resident one's values (its place kept); its entry."""
        cdef bint fresh
        cdef int32_t i = claim(&self.t, key, block_id, ref_cnt, &fresh)
        if fresh:
            self.order.entered(i, tail)
        return i

    cdef int drop_entry(self, int32_t i) except -1:
        self.order.leaving(i)
        release(&self.t, i)
        return 0

    cdef object take(self, Py_ssize_t n, object protected, bint ids):
        """`evict(n, protected)` (n > 0): the victims in order as (key, detached view) pairs, or
        with `ids` as (keys, block ids); None (nothing changed) when there are not n."""
        cdef Table* t = &self.t
        cdef int32_t* chosen
        cdef Py_ssize_t j, got
        if n > t.count or (t.tracking and refuses_in(t, n, protected)):
            return None
        chosen = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        if chosen == NULL:
            raise MemoryError()
        try:
            marked = mark_keys(t, protected)
            try:
                got = self.order.pick(n, chosen)
            finally:
                unmark_keys(t, marked)
            if got == 0:
                return None
            keys = [key_in(t, chosen[j]) for j in range(n)]
            out = (keys, [t.e[chosen[j]].block_id for j in range(n)]) if ids else [
                (keys[j], detached(&t.e[chosen[j]])) for j in range(n)]
            self.order.evicting(chosen, n)
            for j in range(n):
                release(t, chosen[j])
            self.order.evicted()
            return out
        finally:
            PyMem_Free(chosen)

    cdef int unpin_entry(self, int32_t i) except -1:
        forget_pin(&self.t, i)
        return self.order.unpinned(i)

    # ------------------------------------------------------------------ vLLM's CachePolicy calls
    def get(self, key):
        cdef int32_t i = locate_in(&self.t, key)
        return None if i < 0 else view_of(self, i, key)

    def __len__(self):
        return self.t.count

    def insert(self, key, block):
        """Copy `block.block_id` and `block.ref_cnt` into a new entry (`block` is not kept)."""
        self.put(key, block.block_id, block.ref_cnt, False)

    def insert_many(self, keys, blocks, tail=None):
        cdef bint is_tail
        if not self.order.tails:
            tail = None
        for key, block in zip(keys, blocks):
            is_tail = tail is not None and key == tail
            if is_tail:
                tail = None
            self.put(key, block.block_id, block.ref_cnt, is_tail)

    def remove(self, key):
        cdef int32_t i = locate_in(&self.t, key)
        if i >= 0:
            self.drop_entry(i)

    def touch(self, keys):
        self.order.touched(keys if type(keys) is list else list(keys))

    def evict(self, Py_ssize_t n, protected):
        return [] if n <= 0 else self.take(n, protected, False)

    def victims(self, Py_ssize_t n, skip=()):
        return self.order.victims(n, skip)

    def keys(self):
        cdef int32_t i
        return [key_in(&self.t, i) for i in range(self.t.hw) if self.t.e[i].flags & USED]

    def clear(self):
        forget_all(&self.t)
        self.order.cleared()

    def memory_bytes(self):
        """Bytes allocated for the table's arrays now (entries, records, keys, buckets)."""
        return table_bytes(&self.t)

    # ------------------------------------------------------------------ evictable accounting
    def evictable(self, keys, bint flag):
        """`CachePolicy.evictable`: the first notice starts the accounting (entries resident then
        with ref_cnt != 0 count as pinned); then `keys` stop (False) or start (True) being evictable."""
        cdef int32_t i
        if not self.t.tracking:
            self.t.tracking = True
            pin_by_ref_cnt(&self.t)
        for key in keys:
            i = locate_in(&self.t, key)
            if i >= 0:
                if not flag:
                    pin_entry(&self.t, i)
                elif not self.t.e[i].flags & HELD:
                    self.unpin_entry(i)

    def hold(self, keys, bint held=True):
        """`BlockTable.hold`: the resident `keys` are not evictable, whatever their ref_cnt, until
        held again with `held` False (then evictable once no load or write pins them)."""
        cdef int32_t i
        for key in keys:
            i = locate_in(&self.t, key)
            if i < 0:
                continue
            if held:
                self.t.e[i].flags |= HELD
                if self.t.tracking:
                    pin_entry(&self.t, i)
            elif self.t.e[i].flags & HELD:
                self.t.e[i].flags &= ~HELD
                if self.t.tracking and self.t.e[i].ref_cnt == 0:
                    self.unpin_entry(i)

    def pinned_keys(self):
        """The resident keys counted as pinned (a new set), or None when pins are not tracked."""
        cdef Table* t = &self.t
        cdef int32_t i
        if not t.tracking:
            return None
        return {key_in(t, i) for i in range(t.hw) if t.e[i].flags & USED and t.e[i].flags & PINNED}

    def evictable_count(self, protected=()):
        return evictable_in(&self.t, protected) if self.t.tracking else None

    # ------------------------------------------------------------------ the request cycle
    def readable_run(self, keys):
        cdef Py_ssize_t n = 0
        cdef int32_t i
        for key in keys:
            i = locate_in(&self.t, key)
            if i < 0 or self.t.e[i].ref_cnt < 0:
                break
            n += 1
        return n

    def absent(self, keys):
        return [key for key in keys if locate_in(&self.t, key) < 0]

    def insert_written(self, keys, block_ids, tail=None):
        cdef Py_ssize_t j, n = len(keys)
        cdef bint is_tail
        cdef int32_t i
        if len(block_ids) != n:
            raise ValueError(f"insert_written: {n} keys but {len(block_ids)} block ids")
        if not self.order.tails:
            tail = None
        for j in range(n):
            key = keys[j]
            is_tail = tail is not None and key == tail
            if is_tail:
                tail = None
            i = self.put(key, block_ids[j], -1, is_tail)
            if self.t.tracking:
                pin_entry(&self.t, i)

    def insert_ready(self, keys, block_ids):
        cdef Py_ssize_t j, n = len(keys)
        if len(block_ids) != n:
            raise ValueError(f"insert_ready: {n} keys but {len(block_ids)} block ids")
        for j in range(n):
            self.put(keys[j], block_ids[j], 0, False)

    def pin_loads(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t n = len(ks), j
        cdef int32_t* idx = entries_of(&self.t, ks, False)
        cdef Entry* e
        try:
            for j in range(n):
                if idx[j] < 0 or self.t.e[idx[j]].ref_cnt < 0:
                    return None
            ids = [None] * n
            for j in range(n):
                e = &self.t.e[idx[j]]
                e.ref_cnt += 1
                if self.t.tracking:
                    pin_entry(&self.t, idx[j])
                ids[j] = e.block_id
            return ids
        finally:
            PyMem_Free(idx)

    def release_loads(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t j
        cdef int32_t* idx = entries_of(&self.t, ks, True)
        try:
            for j in range(len(ks)):
                self.t.e[idx[j]].ref_cnt -= 1
                if self.t.tracking and self.t.e[idx[j]].ref_cnt == 0 and not self.t.e[idx[j]].flags & HELD:
                    self.unpin_entry(idx[j])
        finally:
            PyMem_Free(idx)

    def mark_written(self, keys):
        cdef list ks = keys if type(keys) is list else list(keys)
        cdef Py_ssize_t n = len(ks), j, k
        cdef int32_t* idx = entries_of(&self.t, ks, False)
        try:
            for j in range(n):
                if idx[j] < 0 or self.t.e[idx[j]].ref_cnt != -1:  # (a key given twice: 0 at its second place)
                    for k in range(j):
                        self.t.e[idx[k]].ref_cnt = -1
                    return False
                self.t.e[idx[j]].ref_cnt = 0
            if self.t.tracking:
                for j in range(n):
                    if not self.t.e[idx[j]].flags & HELD:
                        self.unpin_entry(idx[j])
            return True
        finally:
            PyMem_Free(idx)

    def forget(self, keys):
        cdef int32_t i
        for key in keys:
            i = locate_in(&self.t, key)
            if i >= 0:
                self.drop_entry(i)

    def evict_ids(self, Py_ssize_t n, protected):
        return ([], []) if n <= 0 else self.take(n, protected, True)

    def __repr__(self):
        return f"CompactTable({self.t.label.decode()}, {self.t.count} blocks)"


@cython.final
@cython.freelist(256)
cdef class BlockView:
    """A resident block of a compiled index (what `get` returns), or an evicted one (detached,
    what `evict` returns). `ref_cnt` reads and writes the index's entry; `block_id` is fixed.
    Used after its block left, it raises LookupError (checked by key and block id)."""

    cdef Entry* entry(self) except NULL:
        cdef Table* t = &self.owner.t
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
    v.owner, v.idx, v.key, v.block_id = owner, i, key, owner.t.e[i].block_id
    return v


cdef BlockView detached(Entry* e):
    """A view of an entry about to leave: its block id and ref_cnt, kept in the view."""
    cdef BlockView v = BlockView.__new__(BlockView)
    v.block_id, v.detached_ref = e.block_id, e.ref_cnt
    return v
