# The classes of kvtier/policies/_compact_lru.pyx (included there): the index and its block views.

include "_compact_view.pxi"


cdef class Index:
    """LRU over C arrays (see the module docstring); `kvtier.policies.compact` completes it into a
    `CachePolicy`. Keys are bytes of at most 65535 bytes."""

    cdef Core c
    cdef bint tracking  # evictable accounting on (`track_pins`)
    cdef Py_ssize_t version  # changes with the order, so iterators notice

    def __cinit__(self, cache_capacity, *args, **kwargs):
        core_init(&self.c, cache_capacity)
        self.c.order = Chain(-1, -1)
        self.c.aside = Chain(-1, -1)

    def __dealloc__(self):
        core_free(&self.c)
        PyMem_Free(self.c.heap)

    cdef int32_t locate(self, object key) except -2:
        return locate_in(&self.c, key)

    cdef object key_of(self, int32_t i):
        return key_in(&self.c, i)

    # ------------------------------------------------------------------ the seed contract
    def get(self, key):
        cdef int32_t i = self.locate(key)
        return None if i < 0 else view_of(self, i, key)

    cdef int32_t put(self, object key, int64_t block_id, int32_t ref_cnt) except -1:
        """Enter a block (or overwrite a resident one's values, in the same place, as LRU); its entry."""
        cdef bint fresh
        cdef int32_t i = claim(&self.c, key, block_id, ref_cnt, &fresh)
        if fresh:
            self.c.e[i].seq = 0
            link_tail(&self.c, &self.c.order, i)
            self.version += 1
        return i

    def insert(self, key, block):
        """Copy `block.block_id` and `block.ref_cnt` into a new entry (`block` is not kept)."""
        self.put(key, block.block_id, block.ref_cnt)

    def insert_many(self, keys, blocks, tail=None):
        for key, block in zip(keys, blocks):
            self.put(key, block.block_id, block.ref_cnt)

    def remove(self, key):
        cdef int32_t i = self.locate(key)
        if i >= 0:
            drop(&self.c, i)
            self.version += 1

    def touch(self, keys):
        cdef int32_t i
        cdef Core* c = &self.c
        keys = keys if isinstance(keys, list) else list(keys)
        for key in reversed(keys):
            i = self.locate(key)
            if i >= 0:
                unlink(c, i)
                c.e[i].flags &= ~ASIDE
                link_tail(c, &c.order, i)
        self.version += 1

    def __len__(self):
        return self.c.count

    def keys(self):
        cdef int32_t i
        out = []
        for chain in (self.c.order.head, self.c.aside.head):
            i = chain
            while i >= 0:
                out.append(self.key_of(i))
                i = self.c.e[i].next
        return out

    def clear(self):
        cdef Core* c = &self.c
        forget_all(c)
        c.hlen = 0
        c.order = Chain(-1, -1)
        c.aside = Chain(-1, -1)
        self.version += 1

    # ------------------------------------------------------------------ evictable accounting
    def track_pins(self):
        self.tracking = True
        pin_by_ref_cnt(&self.c)

    def pin(self, keys):
        if self.tracking:
            pin_keys(&self.c, keys)

    def unpin(self, keys):
        if self.tracking:
            unpin_keys(&self.c, keys)

    def pinned_keys(self):
        """The resident keys counted as pinned (a new set), or None when pins are not tracked."""
        return pinned_set(&self.c) if self.tracking else None

    def evictable_count(self, protected=()):
        return evictable_in(&self.c, protected) if self.tracking else None

    def _refuses(self, n, protected):
        return self.tracking and refuses_in(&self.c, n, protected)

    # ------------------------------------------------------------------ decisions
    cdef Py_ssize_t pick(self, Py_ssize_t n, object protected, int32_t* chosen) except -1:
        """Choose `evict(n, protected)`'s victims (0 < n <= count) into `chosen`; 0 when it
        refuses (nothing changed). Protected entries are marked while choosing."""
        cdef Core* c = &self.c
        cdef Py_ssize_t got = 0
        marked = mark_keys(c, protected)
        try:
            got = choose_tracked(c, n, chosen) if self.tracking else choose(c, n, chosen)
        finally:
            unmark_keys(c, marked)
            self.version += 1
        return got

    cdef object take(self, Py_ssize_t n, protected, bint ids):
        """`evict(n, protected)` (n > 0): its victims in order as (key, detached view) pairs, or
        with `ids` as (keys, block ids); None (nothing changed) when there are not n."""
        cdef Core* c = &self.c
        cdef int32_t* chosen
        cdef Py_ssize_t got, j
        if n > c.count or (self.tracking and refuses_in(c, n, protected)):
            return None
        chosen = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        if chosen == NULL:
            raise MemoryError()
        try:
            got = self.pick(n, protected, chosen)
            if got == 0:
                return None
            keys = [self.key_of(chosen[j]) for j in range(got)]
            out = (keys, [c.e[chosen[j]].block_id for j in range(got)]) if ids else [
                (keys[j], detached(&c.e[chosen[j]])) for j in range(got)]
            for j in range(got):
                drop(c, chosen[j])
            return out
        finally:
            PyMem_Free(chosen)

    def evict(self, Py_ssize_t n, protected):
        return [] if n <= 0 else self.take(n, protected, False)

    def victim_candidates(self):
        """Evictable blocks in `evict`'s order (freed aside blocks, then the order); raises
        RuntimeError if the policy changes while the iterator is in use."""
        cdef int32_t i
        cdef Py_ssize_t version = self.version
        heads = [self.c.aside.head, self.c.order.head] if self.tracking else [self.c.order.head]
        for chain in heads:
            i = chain
            while i >= 0:
                if self.c.e[i].ref_cnt == 0 and not self.c.e[i].flags & PINNED:
                    key = self.key_of(i)
                    yield key, view_of(self, i, key)
                    if self.version != version:
                        raise RuntimeError("lru changed during victim_candidates iteration")
                i = self.c.e[i].next

    def victim_keys(self, Py_ssize_t n):
        """The keys of the first `n` blocks `victim_candidates` yields, in one C loop."""
        cdef int32_t i
        cdef Entry* e = self.c.e
        out = []
        heads = [self.c.aside.head, self.c.order.head] if self.tracking else [self.c.order.head]
        for chain in heads:
            i = chain
            while i >= 0 and len(out) < n:
                if e[i].ref_cnt == 0 and not e[i].flags & PINNED:
                    out.append(self.key_of(i))
                i = e[i].next
        return out

    def memory_bytes(self):
        """Bytes allocated for the arrays now (entries, keys, long keys, hash table, freed heap)."""
        cdef Core* c = &self.c
        return (c.cap * sizeof(Entry) + c.cap * c.width + c.long_bytes + (c.mask + 1) * sizeof(int32_t)
                + c.hcap * sizeof(Item))
