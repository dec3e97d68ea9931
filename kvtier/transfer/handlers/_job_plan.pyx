# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled twin of `kvtier.transfer.handlers.job_plan.plan_job_py`: one engine <-> CPU-tier job's
copy descriptors, planned in one pass over the spec's Python lists (no numpy call per group or
reference, no sort). Same inputs, same checks, same messages, same arrays as the pure-Python
twin (tests/handlers/test_job_plan.py compares them on random layouts and jobs)."""

import numpy as np

from libc.stdint cimport int64_t


cdef int64_t _fill(list values, int64_t[::1] out, int64_t limit, str what) except -1:
    """`out[i] = values[i]`, each checked to lie in [0, limit); returns len(values)."""
    cdef Py_ssize_t i, n = len(values)
    cdef int64_t v
    for i in range(n):
        v = values[i]
        if v < 0 or v >= limit:
            if what == "slot":
                raise IndexError(f"slot {v} outside the region's {limit} slots")
            raise IndexError(f"engine block id {v} >= {limit} blocks" if v >= 0 else f"engine block id {v} < 0")
        out[i] = v
    return n


def plan_job(list block_ids, list group_sizes, object block_indices, list slots,
             const int64_t[::1] seg_first, const int64_t[::1] engine_base, const int64_t[::1] engine_stride,
             const int64_t[::1] page, const int64_t[::1] place, int64_t bpc, int64_t engine_blocks,
             int64_t region_base, int64_t region_stride, int64_t region_rows, bint to_cpu):
    """`(src, dst, size)` int64 arrays of the job (see `job_plan.plan_job_py` for the meaning
    of every argument: the same, with the layout's geometry as arrays)."""
    cdef Py_ssize_t groups = seg_first.shape[0] - 1
    cdef Py_ssize_t g, s, k, n, m = 0, first = 0, slot_at = 0, total = 0, cap = 0
    cdef int64_t skip, p, e, c, a, b, pg, needed = 0
    if len(group_sizes) != groups:
        raise ValueError(f"spec has {len(group_sizes)} groups, the KV cache {groups}")
    for g in range(groups):
        n = group_sizes[g]
        if n:
            skip = (<int64_t>block_indices[g]) % bpc if block_indices is not None else 0
            needed += (n + skip + bpc - 1) // bpc
            cap += n * (seg_first[g + 1] - seg_first[g])
        total += n
    if needed != len(slots):
        raise ValueError(f"engine blocks {group_sizes} (block_indices={block_indices}) cover "
                         f"{needed} slots, the tier spec has {len(slots)}")
    ids_arr = np.empty(total, dtype=np.int64)
    slots_arr = np.empty(len(slots), dtype=np.int64)
    cdef int64_t[::1] ids = ids_arr
    cdef int64_t[::1] sl = slots_arr
    _fill(slots, sl, region_rows, "slot")
    _fill(block_ids, ids, engine_blocks, "engine")
    out = np.empty((3, cap), dtype=np.int64)
    cdef int64_t[:, ::1] o = out
    for g in range(groups):
        n = group_sizes[g]
        if n == 0:
            continue
        skip = (<int64_t>block_indices[g]) % bpc if block_indices is not None else 0
        for s in range(seg_first[g], seg_first[g + 1]):
            pg = page[s]
            for k in range(n):
                p = skip + k
                e = engine_base[s] + ids[first + k] * engine_stride[s]
                c = region_base + sl[slot_at + p // bpc] * region_stride + place[s] + (p % bpc) * pg
                if to_cpu:
                    a, b = e, c
                else:
                    a, b = c, e
                if m and o[0, m - 1] + o[2, m - 1] == a and o[1, m - 1] + o[2, m - 1] == b:
                    o[2, m - 1] += pg
                else:
                    o[0, m] = a
                    o[1, m] = b
                    o[2, m] = pg
                    m += 1
        first += n
        slot_at += (n + skip + bpc - 1) // bpc
    return out[0, :m], out[1, :m], out[2, :m]
