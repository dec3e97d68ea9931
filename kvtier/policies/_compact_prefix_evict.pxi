# The decisions of kvtier/policies/_compact_prefix.pyx (included there): eviction, evictable
# accounting and the batch calls of the request cycle.


cdef class CompactPrefixPolicy(Index):
    """`Index` with `evict` (`PrefixFreqCachePolicy.evict`'s walk, `walk` here),
    the eviction order, evictable accounting and the batch calls `CachePolicy` documents."""

    cdef bint tails_one_time(self) except -1:
        """`TailEvidence.one_time(tail_reuse_max)`. Python compares its integer products with
        floats exactly: here they are int64 (exact while every count is below 2**30) compared in
        long double (which holds both without rounding); beyond that, the Python rule itself."""
        cdef int64_t te = self.counts[EVICTED_TAIL], tr = self.counts[RETURNED_TAIL]
        cdef int64_t ne = self.counts[EVICTED_NEW], nr = self.counts[RETURNED_NEW]
        cdef int64_t th = self.counts[HIT_TAIL], nh = self.counts[HIT_NEW]
        cdef int64_t reused = th + tr, left = th + te
        if te + th < 64 or ne + nh < 64:
            return False
        if max(te, tr, ne, nr, th, nh) >= (<int64_t>1 << 30):
            evidence = TailEvidence()
            evidence.counts = self.tail_counts
            return evidence.one_time(self.reuse_max)
        return (<long double>(reused * (nh + ne)) < <long double>(0.5 * <double>(nh + nr) * <double>left)
                and <long double>reused < <long double>(self.reuse_max * <double>left))

    cdef void offsets(self, double* out) noexcept:
        cdef int s
        out[TAIL] = 0.0
        for s in range(1, self.c.nsegs):
            out[s] = self.credit[s - 1] * self.mean_age

    cdef Py_ssize_t find_victims(self, Py_ssize_t n, object protected, int32_t* out, bint exact,
                                 IdxVec* met) except -1:
        """`walk` with `protected` marked: up to n victims in order (with `exact`, n or 0)."""
        cdef double offs[MAX_SEGS]
        cdef Py_ssize_t got
        self.offsets(offs)
        marked = mark_keys(&self.c, protected)
        try:
            got = walk(&self.c, n, out, self.tails_one_time(), offs, met)
        finally:
            unmark_keys(&self.c, marked)
        return got if got == n or not exact else 0

    cdef object take(self, Py_ssize_t n, object protected, bint ids):
        """`evict(n, protected)`'s victims in order as (key, detached view) pairs, or with `ids`
        as (keys, block_ids); None (nothing changed) when there are not n."""
        cdef Core* c = &self.c
        cdef int32_t* chosen
        cdef IdxVec met = IdxVec(NULL, 0, 0)
        cdef Py_ssize_t got, j
        cdef int32_t i
        cdef int s, k
        if n > c.count or (self.tracking and refuses_in(c, n, protected)):
            return None
        chosen = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        if chosen == NULL:
            raise MemoryError()
        try:
            got = self.find_victims(n, protected, chosen, True, &met if self.tracking else NULL)
            if got == 0:
                return None
            keys = [self.key_of(chosen[j]) for j in range(n)]
            out = (keys, [c.e[chosen[j]].block_id for j in range(n)]) if ids else [
                (keys[j], detached(&c.e[chosen[j]])) for j in range(n)]
            self.sync()
            # Ghosts in `_forget`'s order: by segment, the one-time tails last.
            first = 1 if self.tails_one_time() else 0
            for k in range(first, c.nsegs + first):
                s = k % c.nsegs
                for j in range(n):
                    i = chosen[j]
                    if c.e[i].seg == s:
                        ghost_add(&self.gh, key_at(c, i), c.e[i].klen, c.e[i].hash, s)
                        if s <= 1:
                            self.counts[EVICTED_TAIL if s == TAIL else EVICTED_NEW] += 1
            for j in range(n):
                drop(c, chosen[j])
            self.mark = c.count
            for j in range(met.n):
                i = met.v[j]
                if c.e[i].flags & USED and not c.e[i].flags & ASIDE:
                    set_aside(c, i)
            ghost_trim(&self.gh, self.glimit)
            self.version += 1
            return out
        finally:
            PyMem_Free(chosen)
            PyMem_Free(met.v)

    def evict(self, Py_ssize_t n, protected):
        return [] if n <= 0 else self.take(n, protected, False)

    def evict_ids(self, Py_ssize_t n, protected):
        return ([], []) if n <= 0 else self.take(n, protected, True)

    def victim_keys(self, Py_ssize_t n):
        """The keys of the first `n` blocks `victim_candidates` yields, in one C walk."""
        cdef int32_t* out
        cdef Py_ssize_t got, j
        n = min(n, self.c.count)
        if n <= 0:
            return []
        out = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        if out == NULL:
            raise MemoryError()
        try:
            got = self.find_victims(n, (), out, False, NULL)
            return [self.key_of(out[j]) for j in range(got)]
        finally:
            PyMem_Free(out)

    def victim_candidates(self):
        """Evictable blocks in `evict`'s order; raises RuntimeError if the policy changes while
        the iterator is in use. Walks again for twice as many each time it runs out."""
        cdef Py_ssize_t version = self.version, done = 0, want = 64
        while True:
            keys = self.victim_keys(want)
            for key in keys[done:]:
                if self.version != version:
                    raise RuntimeError("prefix-freq changed during victim_candidates iteration")
                yield key, view_of(self, self.locate(key), key)
            if len(keys) < want:
                return
            done, want = len(keys), 2 * want

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

    # ------------------------------------------------------------------ batch calls
    def readable_run(self, keys):
        return readable_run_in(&self.c, keys)

    def absent(self, keys):
        return absent_in(&self.c, keys)

    def insert_written(self, keys, block_ids, tail=None):
        cdef Py_ssize_t j, n = len(keys)
        cdef int32_t i
        cdef bint is_tail
        if len(block_ids) != n:
            raise ValueError(f"insert_written: {n} keys but {len(block_ids)} block ids")
        if not self.demote:
            tail = None
        for j in range(n):
            key = keys[j]
            is_tail = tail is not None and key == tail
            if is_tail:
                tail = None
            i = self.put(key, block_ids[j], -1, is_tail)
            if self.tracking:
                pin_entry(&self.c, i)

    def pin_loads(self, keys):
        return pin_loads_in(&self.c, keys, self.tracking)

    def release_loads(self, keys):
        release_loads_in(&self.c, keys, self.tracking)

    def mark_written(self, keys):
        return mark_written_in(&self.c, keys, self.tracking)
