/* A stand-in libcuda.so.1 for machines without an NVIDIA driver (CI).
 *
 * kvikio dlopen()s the CUDA driver even for host-memory I/O: it asks the driver whether a pointer
 * is device memory. Every entry point here answers CUDA_ERROR_NOT_INITIALIZED (3), which kvikio
 * takes as "not device memory", so its host path (CuFile pread/pwrite futures, thread pool,
 * compat-mode POSIX I/O) runs. cuGetErrorName/String succeed so kvikio can format messages.
 * Build: cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_libcuda.c (see kvtier/testing/fake_cuda.py).
 */
#define NOT_INITIALIZED 3

static const char *name_text = "CUDA_ERROR_NOT_INITIALIZED";
static const char *error_text = "kvtier fake libcuda: no CUDA driver on this machine";

int cuGetErrorName(int error, const char **out) { (void)error; if (out) *out = name_text; return 0; }
int cuGetErrorString(int error, const char **out) { (void)error; if (out) *out = error_text; return 0; }
int cuDriverGetVersion(int *version) { if (version) *version = 13000; return 0; }

#define STUB(name) int name(void) { return NOT_INITIALIZED; }
STUB(cuInit)
STUB(cuDeviceGet)
STUB(cuDeviceGetCount)
STUB(cuDeviceGetAttribute)
STUB(cuDeviceGetName)
STUB(cuDevicePrimaryCtxRetain)
STUB(cuDevicePrimaryCtxRelease)
STUB(cuDevicePrimaryCtxRelease_v2)
STUB(cuDevicePrimaryCtxReset)
STUB(cuCtxCreate)
STUB(cuCtxCreate_v2)
STUB(cuCtxCreate_v3)
STUB(cuCtxCreate_v4)
STUB(cuCtxDestroy)
STUB(cuCtxDestroy_v2)
STUB(cuCtxGetCurrent)
STUB(cuCtxSetCurrent)
STUB(cuCtxPushCurrent)
STUB(cuCtxPushCurrent_v2)
STUB(cuCtxPopCurrent)
STUB(cuCtxPopCurrent_v2)
STUB(cuCtxGetDevice)
STUB(cuCtxSynchronize)
STUB(cuMemAlloc_v2)
STUB(cuMemFree_v2)
STUB(cuMemHostAlloc)
STUB(cuMemFreeHost)
STUB(cuMemHostRegister)
STUB(cuMemHostRegister_v2)
STUB(cuMemHostUnregister)
STUB(cuMemHostGetDevicePointer_v2)
STUB(cuMemcpyHtoDAsync)
STUB(cuMemcpyHtoDAsync_v2)
STUB(cuMemcpyDtoHAsync)
STUB(cuMemcpyDtoHAsync_v2)
STUB(cuMemcpyBatchAsync)
STUB(cuMemcpyBatchAsync_v2)
STUB(cuMemGetAddressRange)
STUB(cuMemGetAddressRange_v2)
STUB(cuPointerGetAttribute)
STUB(cuPointerGetAttributes)
STUB(cuStreamCreate)
STUB(cuStreamDestroy)
STUB(cuStreamDestroy_v2)
STUB(cuStreamSynchronize)
STUB(cuEventCreate)
STUB(cuEventDestroy)
STUB(cuEventDestroy_v2)
STUB(cuEventRecord)
STUB(cuEventQuery)
STUB(cuEventSynchronize)
STUB(cuGetProcAddress)
STUB(cuGetProcAddress_v2)
STUB(cuMemcpyAsync)
STUB(cuLaunchHostFunc)
