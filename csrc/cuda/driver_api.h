// The part of the CUDA driver API (libcuda) tutel uses, declared here so that
// building tutel needs no CUDA header.  One row per function:
//   X(name, symbol exported by libcuda, (parameter types))
// where the symbol carries the version suffix cuda.h maps the name to.  Enum
// parameters are passed as int (the enums are int-sized).  Types, constants,
// symbols and signatures are checked against NVIDIA's cuda.h by
// tests/abi/cuda_abi_check.cpp.
#pragma once

#include <cstddef>

// The opaque handle types, with cuda.h's own struct names.
struct CUctx_st;
struct CUmod_st;
struct CUfunc_st;
struct CUstream_st;

namespace tutel {
namespace cuda {

using CUresult = int;
using CUdevice = int;
using CUcontext = ::CUctx_st*;
using CUmodule = ::CUmod_st*;
using CUfunction = ::CUfunc_st*;
using CUstream = ::CUstream_st*;
using CUdeviceptr = unsigned long long;

namespace driver_api {

constexpr CUresult kSuccess = 0;
constexpr int kAttributeMultiprocessorCount = 16;      // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
constexpr int kAttributeComputeCapabilityMajor = 75;   // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttributeComputeCapabilityMinor = 76;   // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
constexpr int kCaptureStatusNone = 0;                  // CU_STREAM_CAPTURE_STATUS_NONE
constexpr int kCaptureModeRelaxed = 2;                 // CU_STREAM_CAPTURE_MODE_RELAXED
constexpr unsigned kHostAllocPortable = 0x01;          // CU_MEMHOSTALLOC_PORTABLE
constexpr unsigned kHostAllocDeviceMap = 0x02;         // CU_MEMHOSTALLOC_DEVICEMAP
constexpr int kJitErrorLogBuffer = 5;                  // CU_JIT_ERROR_LOG_BUFFER
constexpr int kJitErrorLogBufferSizeBytes = 6;         // CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES

#define TUTEL_DRIVER_FUNCTIONS(X)                                                              \
  X(cuInit, "cuInit", (unsigned int))                                                          \
  X(cuDriverGetVersion, "cuDriverGetVersion", (int*))                                          \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice*, int))                                              \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute", (int*, int, CUdevice))                       \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext*, CUdevice))              \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext*))                                          \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                                           \
  X(cuCtxSynchronize, "cuCtxSynchronize", ())                                                  \
  X(cuModuleLoadDataEx, "cuModuleLoadDataEx",                                                  \
    (CUmodule*, const void*, unsigned int, int*, void**))                                      \
  X(cuModuleGetFunction, "cuModuleGetFunction", (CUfunction*, CUmodule, const char*))          \
  X(cuLaunchKernel, "cuLaunchKernel",                                                          \
    (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,         \
     unsigned int, unsigned int, CUstream, void**, void**))                                    \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr*, size_t))                                       \
  X(cuMemcpyDtoH, "cuMemcpyDtoH_v2", (void*, CUdeviceptr, size_t))                             \
  X(cuMemcpyHtoD, "cuMemcpyHtoD_v2", (CUdeviceptr, const void*, size_t))                       \
  X(cuMemsetD32Async, "cuMemsetD32Async", (CUdeviceptr, unsigned int, size_t, CUstream))       \
  X(cuMemHostAlloc, "cuMemHostAlloc", (void**, size_t, unsigned int))                          \
  X(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2",                                 \
    (CUdeviceptr*, void*, unsigned int))                                                       \
  X(cuStreamIsCapturing, "cuStreamIsCapturing", (CUstream, int*))                              \
  X(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", (int*))            \
  X(cuGetErrorName, "cuGetErrorName", (CUresult, const char**))                                \
  X(cuGetErrorString, "cuGetErrorString", (CUresult, const char**))

// Table of the functions, filled by dlsym.
struct Functions {
#define TUTEL_DRIVER_MEMBER(name, symbol, params) CUresult(*name) params = nullptr;
  TUTEL_DRIVER_FUNCTIONS(TUTEL_DRIVER_MEMBER)
#undef TUTEL_DRIVER_MEMBER
};

}  // namespace driver_api
}  // namespace cuda
}  // namespace tutel
