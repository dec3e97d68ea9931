"""Row copies between tensors: `out[i] = src[index[i]]` and `dst[index[i]] = src[i]` along dim 0.

On the host a large copy is cut into one part per torch intra-op thread and the parts run side by
side on a `RowCopier`'s own thread pool (torch's `index_select` and numpy's row assignment release
the GIL); the copier is closed with the handler that owns it. On a device the copies are torch's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# A host row copy this large is split across torch's intra-op threads (index_select alone uses one
# thread for rows of 256 KiB-1 MiB). Measured figures: docs/bench.md, "Engine ↔ CPU on the host".
PARALLEL_COPY_BYTES = 4 << 20


class RowCopier:
    """Host row copies, large ones in parts on a private thread pool made on first use.

    `parallel_bytes` is the size from which a copy is cut into parts (None: `PARALLEL_COPY_BYTES`,
    read at each copy). `close()` shuts the pool down; a closed copier still copies, in one part.
    Thread-safe: several jobs may copy at once (their parts share the pool).
    """

    def __init__(self, parallel_bytes: int | None = None):
        self.parallel_bytes = parallel_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 0
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Shut the pool down (waiting for running parts). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _threshold(self) -> int:
        return PARALLEL_COPY_BYTES if self.parallel_bytes is None else self.parallel_bytes

    def _pool_of(self, threads: int) -> ThreadPoolExecutor | None:
        """The pool with `threads` workers (remade when torch's thread count changed); None once closed."""
        with self._lock:
            if self._closed:
                return None
            if self._pool is None or self._pool_threads != threads:
                old, self._pool_threads = self._pool, threads
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-rows")
                if old is not None:
                    old.shutdown(wait=False)  # running parts finish; their callers hold the futures
            return self._pool

    def in_parts(self, rows: int, nbytes: int, copy_rows: Callable[[int, int], object]) -> None:
        """`copy_rows(start, stop)` over `0..rows`: at once, or for a large host copy in one part
        per torch thread, run side by side (the parts must write disjoint rows)."""
        import torch

        threads = torch.get_num_threads()
        pool = None
        if threads >= 2 and rows >= 2 and nbytes >= self._threshold():
            pool = self._pool_of(threads)
        if pool is None:
            copy_rows(0, rows)
            return
        cuts = [rows * i // threads for i in range(threads + 1)]
        for part in [pool.submit(copy_rows, cuts[i], cuts[i + 1]) for i in range(threads)]:
            part.result()

    def index_select(self, src, index, out) -> None:
        """`out[i] = src[index[i]]` along dim 0 (`torch.index_select(..., out=out)`). On the host, in
        parts, with numpy's unbuffered `take` where `out` is contiguous (torch's index_select, run
        from two threads, runs into its own intra-op threads: docs/bench.md)."""
        import torch

        if out.device.type != "cpu" or src.device.type != "cpu":
            torch.index_select(src, 0, index, out=out)
            return
        nbytes = out.numel() * out.element_size()
        try:
            import numpy as np

            if not (out.is_contiguous() and src.is_contiguous()):
                raise RuntimeError("strided")
            values, rows, dst = src.numpy(), index.numpy(), out.numpy()
        except (ImportError, RuntimeError):  # no numpy, or a strided view: torch's index_select
            self.in_parts(len(index), nbytes, lambda a, b: torch.index_select(src, 0, index[a:b], out=out[a:b]))
            return
        if len(rows) and (rows.min() < 0 or rows.max() >= len(values)):
            raise IndexError(f"row index out of range 0..{len(values) - 1}: {rows.min()}..{rows.max()}")
        if dst.shape != (len(rows), *values.shape[1:]):
            raise ValueError(f"index_select: out has shape {dst.shape}, expected {(len(rows), *values.shape[1:])}")
        # mode="clip" (indices checked above) keeps numpy from buffering `out`.
        self.in_parts(len(rows), nbytes, lambda a, b: np.take(values, rows[a:b], axis=0, out=dst[a:b], mode="clip"))

    def index_copy(self, dst, index, src) -> None:
        """`dst[index[i]] = src[i]` along dim 0. On the host numpy's row assignment (one memcpy per
        row) runs at memory speed where torch's `index_copy_` reaches about 75% of it; it runs in
        parts when the rows are distinct (repeated rows: numpy's order, the last one wins)."""
        if dst.device.type == "cpu" and src.device.type == "cpu":
            try:
                out, rows, values = dst.numpy(), index.numpy(), src.numpy()
            except RuntimeError:  # torch built without numpy support
                pass
            else:
                if values.nbytes < self._threshold() or len(set(rows.tolist())) != len(rows):
                    out[rows] = values  # one call (repeated rows must not be split across parts)
                    return

                def copy_rows(a: int, b: int) -> None:
                    out[rows[a:b]] = values[a:b]

                self.in_parts(len(rows), values.nbytes, copy_rows)
                return
        dst.index_copy_(0, index, src)


def words(t):
    """`t` (a uint8 tensor whose last dim is contiguous) viewed as the widest integer type that
    divides its last size, its strides and its address; copies move words instead of bytes."""
    import torch

    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if (t.shape[-1] % width == 0 and t.data_ptr() % width == 0
                and all(s % width == 0 for s in t.stride()[:-1])):
            return t.view(dtype)
    return t


def common_words(a, b):
    """`a` and `b` reinterpreted with the narrower of their integer types (same bytes per row)."""
    import torch

    if a.element_size() == b.element_size():
        return a, b
    if a.element_size() > b.element_size():
        return a.view(torch.uint8).view(b.dtype), b
    return a, b.view(torch.uint8).view(a.dtype)


def run_start(positions) -> int | None:
    """`positions[0]` if `positions` (host int64) is `start, start+1, ...`, else None."""
    m = len(positions)
    if m == 0:
        return None
    first = int(positions[0])
    if int(positions[-1]) - first != m - 1:
        return None
    if m > 1 and not bool((positions[1:] - positions[:-1] == 1).all()):
        return None
    return first
