# The classes of kvtier/policies/_compact_prefix.pyx (included there): the policy's index and its
# block views.

include "_compact_view.pxi"


cdef class Index:
    """`PrefixFreqCachePolicy`'s decisions over C arrays (see the module docstring);
    `kvtier.policies.compact_prefix` completes it into a `CachePolicy`. The tuning is read from
    the class attributes `credits`, `tail_reuse_max`, `ghost_fraction`, `max_ghost_limit`,
    `unit_rate` and `demote_tail` when an instance is made. Keys are bytes of at most 65535 bytes."""

    cdef Core c
    cdef bint tracking  # evictable accounting on (`track_pins`)
    cdef Py_ssize_t version  # changes with the order, so iterators notice
    cdef double now  # the logical clock (an integer held in a double)
    cdef double mean_age  # `unit`: clock ticks per credit
    cdef Py_ssize_t mark  # the count when the clock was last synced
    cdef double rate, reuse_max
    cdef double credit[MAX_SEGS]
    cdef bint demote
    cdef int64_t counts[6]
    cdef Ghosts gh  # the ghost list: evicted keys and their segment then, oldest first
    cdef Py_ssize_t glimit
    cdef Py_ssize_t capacity  # as given (the arrays may grow past it)

    def __cinit__(self, cache_capacity, *args, **kwargs):
        cdef int s
        cls = type(self)
        core_init(&self.c, cache_capacity)
        cap = self.capacity = self.c.want
        for s in range(MAX_SEGS):
            self.c.seg[s] = Chain(-1, -1)
        credits = tuple(cls.credits)
        if not 1 <= len(credits) < MAX_SEGS:
            raise ValueError(f"prefix-freq: credits must hold 1 to {MAX_SEGS - 1} values, got {len(credits)}")
        self.c.nsegs = len(credits) + 1
        for s in range(len(credits)):
            self.credit[s] = credits[s]
        self.rate, self.reuse_max, self.demote = cls.unit_rate, cls.tail_reuse_max, cls.demote_tail
        self.glimit = min(int(cap * cls.ghost_fraction), cls.max_ghost_limit)
        self.mean_age = float(cap)

    def __dealloc__(self):
        cdef int s
        core_free(&self.c)
        for s in range(MAX_SEGS):
            PyMem_Free(self.c.freed[s].items)
        ghost_free(&self.gh)

    cdef int32_t locate(self, object key) except -2:
        return locate_in(&self.c, key)

    cdef object key_of(self, int32_t i):
        return key_in(&self.c, i)

    cdef double sync(self):
        """Advance the clock by the blocks inserted since it was last synced; returns it."""
        self.now += self.c.count - self.mark
        self.mark = self.c.count
        return self.now

    # ------------------------------------------------------------------ inspection
    @property
    def ghosts(self):
        """Evicted key -> its segment then, oldest first (a new dict: inspection, O(ghosts))."""
        return ghost_dict(&self.gh)

    @property
    def ghost_limit(self):
        """Ghosts kept: between 1x and 2x this many keys."""
        return self.glimit

    @ghost_limit.setter
    def ghost_limit(self, Py_ssize_t limit):
        self.glimit = limit

    @property
    def clock(self):
        return self.now

    @property
    def unit(self):
        return self.mean_age

    @property
    def tail_counts(self):
        """The departures of tails and new blocks (`TailEvidence.counts`, a copy); settable, as
        evidence carried over from another instance."""
        return [self.counts[k] for k in range(6)]

    @tail_counts.setter
    def tail_counts(self, counts):
        cdef int k
        values = [int(v) for v in counts]
        if len(values) != 6 or min(values) < 0:
            raise ValueError(f"prefix-freq: tail_counts must be 6 counts >= 0, got {counts!r}")
        for k in range(6):
            self.counts[k] = values[k]

    @property
    def aside(self):
        """The keys set aside now (pinned or protected when an eviction met them): inspection, O(n)."""
        cdef int32_t i
        return [self.key_of(i) for i in range(self.c.hw) if self.c.e[i].flags & USED and self.c.e[i].flags & ASIDE]

    def memory_bytes(self):
        """Bytes allocated for the arrays now (entries, keys, long keys, hash table, queues); not
        the ghosts."""
        cdef Core* c = &self.c
        return (c.cap * sizeof(Entry) + c.cap * c.width + c.long_bytes + (c.mask + 1) * sizeof(int32_t)
                + sum(c.freed[s].cap for s in range(MAX_SEGS)) * sizeof(Freed))

    # ------------------------------------------------------------------ the seed contract
    def get(self, key):
        cdef int32_t i = self.locate(key)
        return None if i < 0 else view_of(self, i, key)

    cdef int destination(self, int32_t i, bint tail) except -1:
        """The segment of entry i, just inserted (`PrefixFreqCachePolicy._place`): a returning
        ghost by its history (the re-store counts as a hit), else the tails or the new blocks."""
        cdef int ghost = ghost_pop(&self.gh, key_at(&self.c, i), self.c.e[i].klen, self.c.e[i].hash)
        if ghost < 0:
            return TAIL if tail and self.demote else 1
        if ghost <= 1:
            self.counts[RETURNED_TAIL if ghost == TAIL else RETURNED_NEW] += 1
        return min(max(ghost, 1) + 1, self.c.nsegs - 1)

    cdef int32_t put(self, object key, int64_t block_id, int32_t ref_cnt, bint tail) except -1:
        """Enter a block (a resident one: its values overwritten, its place kept); its entry.
        The clock is not advanced: `sync` counts the inserts at the next call that reads it."""
        cdef bint fresh
        cdef int32_t i = claim(&self.c, key, block_id, ref_cnt, &fresh)
        if fresh:
            place(&self.c, i, self.destination(i, tail), self.now)
            self.version += 1
        return i

    def insert(self, key, block):
        """Copy `block.block_id` and `block.ref_cnt` into a new entry (`block` is not kept)."""
        self.put(key, block.block_id, block.ref_cnt, False)

    def insert_many(self, keys, blocks, tail=None):
        cdef bint is_tail
        if not self.demote:
            tail = None
        for key, block in zip(keys, blocks):
            is_tail = tail is not None and key == tail
            if is_tail:
                tail = None
            self.put(key, block.block_id, block.ref_cnt, is_tail)

    def remove(self, key):
        cdef int32_t i
        self.sync()
        i = self.locate(key)
        if i >= 0:
            drop(&self.c, i)
            self.version += 1
        self.mark = self.c.count

    def touch(self, keys):
        cdef Core* c = &self.c
        cdef double now = self.sync(), unit = self.mean_age, rate = self.rate, stamp
        cdef int32_t i
        cdef int s, top = c.nsegs - 1
        keys = keys if isinstance(keys, list) else list(keys)
        for key in reversed(keys):
            i = self.locate(key)
            if i < 0:
                continue
            s = c.e[i].seg
            if c.e[i].flags & ASIDE:
                c.e[i].flags &= ~ASIDE  # touched: back in the order, in the segment it moves to
            else:
                unlink(c, i)
            stamp = c.e[i].stamp
            now += 1.0
            unit += (now - stamp - unit) * rate
            if s <= 1:
                self.counts[HIT_TAIL if s == TAIL else HIT_NEW] += 1
            place(c, i, 2 if s == TAIL else min(s + 1, top), now)
        self.now, self.mean_age = now, unit
        self.version += 1

    def __len__(self):
        return self.c.count

    def keys(self):
        cdef int32_t i
        return [self.key_of(i) for i in range(self.c.hw) if self.c.e[i].flags & USED]

    def clear(self):
        cdef Core* c = &self.c
        cdef int s
        forget_all(c)
        for s in range(MAX_SEGS):
            c.seg[s] = Chain(-1, -1)
            c.freed[s].n = 0
        ghost_clear(&self.gh)
        for s in range(6):
            self.counts[s] = 0
        self.now, self.mark, self.mean_age = 0.0, 0, float(self.capacity)
        self.version += 1
