# cython: language_level=3, boundscheck=False, wraparound=False
"""A compiled loop of `cudaMemcpyAsync` calls over a copy plan's descriptor arrays.

The function is passed as an address (the caller finds `cudaMemcpyAsync` in the libcudart the
process already loaded, with dlopen through ctypes), so this module builds without CUDA headers
or libraries, and a test can pass any function with the same C signature (a ctypes callback
that does memmove). The loop runs without the GIL and stops at the first non-zero return code.
"""

from libc.stdint cimport int64_t, uintptr_t

# cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind,
#                             cudaStream_t stream); both enums are C ints.
ctypedef int (*memcpy_async_t)(void *dst, const void *src, size_t count, int kind,
                               void *stream) noexcept nogil


def submit_copies(uintptr_t function, const int64_t[::1] dst, const int64_t[::1] src,
                  const int64_t[::1] size, int kind, uintptr_t stream):
    """Call `function(dst[i], src[i], size[i], kind, stream)` for i = 0..n-1, in order.

    Returns `(code, done)`: `(0, n)` when every call returned 0, else the first non-zero code and
    the index of the descriptor that returned it (descriptors before it were submitted, none
    after). Raises ValueError for arrays of different lengths or a null function."""
    cdef Py_ssize_t n = size.shape[0]
    cdef Py_ssize_t i = 0
    cdef int code = 0
    if dst.shape[0] != n or src.shape[0] != n:
        raise ValueError(f"descriptor arrays differ in length: dst {dst.shape[0]}, src {src.shape[0]}, size {n}")
    if function == 0:
        raise ValueError("null cudaMemcpyAsync address")
    cdef memcpy_async_t call = <memcpy_async_t>function
    with nogil:
        while i < n:
            code = call(<void *><uintptr_t>dst[i], <const void *><uintptr_t>src[i], <size_t>size[i], kind,
                        <void *>stream)
            if code != 0:
                break
            i += 1
    return code, i
