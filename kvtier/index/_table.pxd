# The compiled block table of a tier (kvtier/index/_table.pyx), declared once: the C layout, the
# small hot functions (`cdef inline`, compiled into each module that cimports them) and the
# functions implemented in _table.pyx. Its Python-visible side (`CompactTable`, the eviction
# orders' base `CompactOrder`, the block views) is kvtier/index/_table_api.pxd. The compiled
# orders (kvtier/policies/_compact_lru.pyx, _compact_prefix*.pyx) cimport both: a table is
# composed with one order, which keeps its records and lists and reads the entries.
#
# Layout, per entry (an int32 entry number i, at most MAX_ENTRIES):
# - `Entry` (24 bytes): block id, key hash, ref_cnt, key length, flags, one byte for the policy;
# - the order's record (`rec_size` bytes, starting with its `Links`), in a parallel array that
#   the table allocates and grows with the entries, so entry i's record is at rec + i * rec_size;
# - the key in slot i of a key array `width` bytes wide (the longest key seen up to INLINE_KEY;
#   a longer key has an allocation of its own and its slot holds the address);
# - two int32 buckets of an open-addressing hash table (linear probing, backward-shift deletion,
#   no tombstones; at most half full).
# The arrays grow as blocks are inserted (doubling, up to `cache_capacity`, then doubling again if
# more are ever inserted), so a large capacity costs nothing until it is used.

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject_Hash
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport free
from libc.string cimport memcmp, memcpy


cdef enum:
    USED = 1  # resident (a free entry has no flag)
    PINNED = 2  # counted as pinned (evictable accounting, `evictable` notices)
    MARK = 8  # in `protected` during one eviction
    HELD = 16  # kept from eviction by a retention (`hold`): pinned whatever its ref_cnt
    POLICY_FLAGS = 0xE4  # the flag bits the table leaves to the policy (lru and prefix-freq: 4, ASIDE)
    MAX_KEY = 65535
    MAX_ENTRIES = 1 << 30
    INLINE_KEY = 64  # longer keys live outside the key array
    FIRST_ENTRIES = 1024  # entries allocated when a table is made

ctypedef struct Entry:
    int64_t block_id  # the slot (a free entry: the next free entry, or -1)
    Py_hash_t hash
    int32_t ref_cnt  # -1 being written, 0 readable, n > 0 pinned by n loads
    uint16_t klen
    uint8_t flags
    uint8_t spare  # the policy's (prefix-freq: the entry's segment)

ctypedef struct Links:  # the first field of every policy record: its place in one of its lists
    int32_t prev
    int32_t next

ctypedef struct Chain:  # a doubly-linked list of entries through their records' Links (-1: none)
    int32_t head
    int32_t tail

ctypedef struct Table:
    Entry* e
    char* rec  # the policy's records
    size_t rec_size
    char* keys
    Py_ssize_t width
    int32_t cap  # entries allocated
    int32_t want  # cache_capacity: the arrays grow to it, doubling, as blocks are inserted
    Py_ssize_t long_bytes  # bytes of the keys longer than INLINE_KEY (allocated one by one)
    int32_t hw  # entries ever used (the rest of the arrays is untouched)
    int32_t free  # free list head
    int32_t* buckets  # the hash table: entry numbers, -1 empty
    size_t mask  # buckets - 1 (a power of two)
    Py_ssize_t count  # resident entries
    Py_ssize_t npinned  # entries flagged PINNED
    bint tracking  # evictable accounting on (the first `evictable` notice): PINNED is kept exact
    const char* label  # the policy's name, for messages


# ---------------------------------------------------------------------- key slots
# Slot i of a key array `width` bytes wide holds a key of up to INLINE_KEY bytes inline, or the
# address of a longer key's own allocation (freed by `slot_free` when the key is forgotten). The
# ghost list of prefix-freq uses the same slots.

cdef inline Py_ssize_t slot_width(Py_ssize_t klen) noexcept nogil:
    """Bytes a key of `klen` bytes takes in its slot: itself, or the address of its allocation."""
    return klen if klen <= INLINE_KEY else <Py_ssize_t>sizeof(char*)


cdef inline char* slot_at(char* keys, Py_ssize_t width, Py_ssize_t i) noexcept nogil:
    return keys + i * width


cdef inline char* slot_address(char* keys, Py_ssize_t width, Py_ssize_t i) noexcept nogil:
    """The address a long key's slot holds (copied out: a slot is not aligned for a pointer)."""
    cdef char* p
    memcpy(&p, slot_at(keys, width, i), sizeof(char*))
    return p


cdef inline char* slot_key(char* keys, Py_ssize_t width, Py_ssize_t i, Py_ssize_t klen) noexcept nogil:
    """The bytes of the key of `klen` bytes in slot i."""
    if klen <= INLINE_KEY:
        return slot_at(keys, width, i)
    return slot_address(keys, width, i)


cdef inline void slot_fill(char* keys, Py_ssize_t width, Py_ssize_t i, const char* kp, Py_ssize_t klen,
                           char* copy) noexcept nogil:
    """Put a key in slot i: inline, or the address of its `long_copy` (made beforehand, so that
    nothing can fail once an entry is taken)."""
    if klen <= INLINE_KEY:
        memcpy(slot_at(keys, width, i), kp, klen)
    else:
        memcpy(slot_at(keys, width, i), &copy, sizeof(char*))


cdef inline void slot_move(char* dst, Py_ssize_t dst_width, Py_ssize_t k, char* src, Py_ssize_t src_width,
                           Py_ssize_t i, Py_ssize_t klen) noexcept nogil:
    """Slot i of `src` to slot k of `dst` (a long key's allocation changes owner, not place)."""
    memcpy(slot_at(dst, dst_width, k), slot_at(src, src_width, i), slot_width(klen))


cdef inline void slot_free(char* keys, Py_ssize_t width, Py_ssize_t i, Py_ssize_t klen) noexcept nogil:
    """Free the allocation of slot i's key, if it is a long one."""
    if klen > INLINE_KEY:
        free(slot_address(keys, width, i))


cdef char* long_copy(const char* kp, Py_ssize_t klen) except NULL


# ---------------------------------------------------------------------- hash tables
# An open-addressing table of int32 entry numbers, linear probing, `mask + 1` buckets. Entry i's
# hash is read at `hashes + i * stride` (the hash field of entry 0 and the entry size), so the
# block table and the ghost list share this code.

cdef inline Py_hash_t hash_of(const char* hashes, size_t stride, int32_t i) noexcept nogil:
    return (<const Py_hash_t*>(hashes + <size_t>i * stride))[0]


cdef inline void slot_put(int32_t* buckets, size_t mask, Py_hash_t h, int32_t i) noexcept nogil:
    cdef size_t s = (<size_t>h) & mask
    while buckets[s] >= 0:
        s = (s + 1) & mask
    buckets[s] = i


cdef inline int32_t slot_find(const int32_t* buckets, size_t mask, const char* hashes, const char* klens,
                              size_t stride, char* keys, Py_ssize_t width, const char* kp, Py_ssize_t klen,
                              Py_hash_t h) noexcept nogil:
    """The entry holding this key (its bytes, length and hash), or -1. Entry i's uint16 key length
    is read at `klens + i * stride`, its key in slot i of `keys`."""
    cdef size_t s = (<size_t>h) & mask
    cdef int32_t i
    cdef Py_ssize_t n
    while True:
        i = buckets[s]
        if i < 0:
            return -1
        if hash_of(hashes, stride, i) == h:
            n = (<const uint16_t*>(klens + <size_t>i * stride))[0]
            if n == klen and memcmp(slot_key(keys, width, i, n), kp, klen) == 0:
                return i
        s = (s + 1) & mask


cdef void slot_del(int32_t* buckets, size_t mask, const char* hashes, size_t stride, int32_t i) noexcept nogil


cdef inline size_t table_slots(Py_ssize_t entries) noexcept nogil:
    """Buckets for up to `entries` entries: a power of two, at most half full (>= 8)."""
    cdef size_t slots = 8
    while slots < <size_t>(2 * entries):
        slots *= 2
    return slots


# ---------------------------------------------------------------------- entries
cdef inline char* key_at(Table* t, int32_t i) noexcept nogil:
    return slot_key(t.keys, t.width, i, t.e[i].klen)


cdef inline int32_t find(Table* t, const char* kp, Py_ssize_t klen, Py_hash_t h) noexcept nogil:
    return slot_find(t.buckets, t.mask, <const char*>&t.e[0].hash, <const char*>&t.e[0].klen, sizeof(Entry),
                     t.keys, t.width, kp, klen, h)


cdef inline int32_t locate_in(Table* t, object key) except -2:
    """The entry of `key`, or -1 (not resident; not bytes, or longer than any inline key entered)."""
    cdef Py_ssize_t klen
    if not PyBytes_Check(key):
        return -1
    klen = PyBytes_GET_SIZE(key)
    if t.count == 0 or (klen <= INLINE_KEY and klen > t.width):
        return -1
    return find(t, PyBytes_AS_STRING(key), klen, PyObject_Hash(key))


cdef inline object key_in(Table* t, int32_t i):
    return PyBytes_FromStringAndSize(key_at(t, i), t.e[i].klen)


cdef inline void pin_entry(Table* t, int32_t i) noexcept nogil:
    """Entry i is not evictable any more (`pin`, evictable accounting)."""
    if not t.e[i].flags & PINNED:
        t.e[i].flags |= PINNED
        t.npinned += 1


cdef inline void forget_pin(Table* t, int32_t i) noexcept nogil:
    """Entry i is no longer counted as pinned."""
    if t.e[i].flags & PINNED:
        t.e[i].flags &= ~PINNED
        t.npinned -= 1


cdef int table_init(Table* t, object cache_capacity, size_t rec_size, const char* label) except -1
cdef void table_free(Table* t) noexcept
cdef int32_t claim(Table* t, object key, int64_t block_id, int32_t ref_cnt, bint* fresh) except -1
cdef void release(Table* t, int32_t i) noexcept nogil
cdef void forget_all(Table* t) noexcept nogil
cdef size_t table_bytes(Table* t) noexcept nogil
cdef int reserve(void** items, Py_ssize_t n, Py_ssize_t* cap, size_t size) except -1
cdef int32_t* entries_of(Table* t, list keys, bint resident) except NULL
cdef void pin_by_ref_cnt(Table* t) noexcept nogil
cdef Py_ssize_t evictable_in(Table* t, object protected) except -1
cdef list mark_keys(Table* t, object keys)
cdef void unmark_keys(Table* t, list marked)
cdef bint refuses_in(Table* t, Py_ssize_t n, object protected) except -1


# ---------------------------------------------------------------------- the policy's lists
cdef inline Links* links_at(Table* t, int32_t i) noexcept nogil:
    """The Links that start entry i's policy record."""
    return <Links*>(t.rec + <size_t>i * t.rec_size)


cdef inline void chain_append(Table* t, Chain* l, int32_t i) noexcept nogil:
    """Entry i at the tail of list l."""
    cdef Links* x = links_at(t, i)
    x.next = -1
    x.prev = l.tail
    if l.tail >= 0:
        links_at(t, l.tail).next = i
    else:
        l.head = i
    l.tail = i


cdef inline void chain_remove(Table* t, Chain* l, int32_t i) noexcept nogil:
    """Entry i out of list l (its Links are left as they were)."""
    cdef Links* x = links_at(t, i)
    if x.prev >= 0:
        links_at(t, x.prev).next = x.next
    else:
        l.head = x.next
    if x.next >= 0:
        links_at(t, x.next).prev = x.prev
    else:
        l.tail = x.prev
