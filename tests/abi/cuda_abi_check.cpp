// Compile-time check that tutel's own declarations of the CUDA driver and NVRTC
// APIs (csrc/cuda/driver_api.h, csrc/cuda/nvrtc_api.h, which let tutel build
// without CUDA headers) match NVIDIA's cuda.h and nvrtc.h: signatures,
// versioned symbol names and constants.  Nothing runs; it only has to
// compile (tests/python/test_cuda_host_compiles.py does that).
#include <cuda.h>
#include <nvrtc.h>

#include <type_traits>

#include "cuda/driver_api.h"
#include "cuda/nvrtc_api.h"

namespace {

// A and B are passed the same way: the same type, or an int-sized enum where
// tutel says int, through pointers and const.
template <class A, class B>
struct SameAbi : std::is_same<A, B> {};
template <class A, class B>
struct SameAbi<A*, B*> : SameAbi<A, B> {};
template <class A, class B>
struct SameAbi<const A, const B> : SameAbi<A, B> {};
template <class E>
struct SameAbi<E, int>
    : std::integral_constant<bool, std::is_same<E, int>::value ||
                                       (std::is_enum<E>::value && sizeof(E) == sizeof(int))> {};

template <class... T>
struct List {};
template <class L1, class L2>
struct AllSameAbi : std::false_type {};  // different arity
template <>
struct AllSameAbi<List<>, List<>> : std::true_type {};
template <class A, class... As, class B, class... Bs>
struct AllSameAbi<List<A, As...>, List<B, Bs...>>
    : std::integral_constant<bool, SameAbi<A, B>::value && AllSameAbi<List<As...>, List<Bs...>>::value> {};

template <class F, class G>
struct SameSignature : std::false_type {};
template <class R1, class... A1, class R2, class... A2>
struct SameSignature<R1(A1...), R2(A2...)>
    : std::integral_constant<bool, SameAbi<R1, R2>::value && AllSameAbi<List<A1...>, List<A2...>>::value> {};

constexpr bool same_string(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || same_string(a + 1, b + 1));
}

#define TUTEL_STRINGIFY_EXPANDED(x) #x
#define TUTEL_STRINGIFY(x) TUTEL_STRINGIFY_EXPANDED(x)

using tutel::cuda::CUresult;

// cuda.h maps some names to versioned symbols (cuMemAlloc -> cuMemAlloc_v2):
// `name` below is expanded by it, so the symbol tutel looks up must be the
// expanded name.
#define TUTEL_CHECK_DRIVER(name, symbol, params)                                     \
  static_assert(SameSignature<decltype(::name), CUresult params>::value,             \
                #name ": signature differs from cuda.h");                            \
  static_assert(same_string(TUTEL_STRINGIFY(name), symbol), #name ": libcuda exports it as " \
                TUTEL_STRINGIFY(name));
TUTEL_DRIVER_FUNCTIONS(TUTEL_CHECK_DRIVER)

#define TUTEL_CHECK_NVRTC(name, result, params)                                      \
  static_assert(SameSignature<decltype(::name), result params>::value,               \
                #name ": signature differs from nvrtc.h");
namespace nvrtc_check {
using namespace tutel::cuda::nvrtc_api;
TUTEL_NVRTC_FUNCTIONS(TUTEL_CHECK_NVRTC)
}  // namespace nvrtc_check

namespace api = tutel::cuda::driver_api;
static_assert(std::is_same<tutel::cuda::CUcontext, ::CUcontext>::value, "CUcontext");
static_assert(std::is_same<tutel::cuda::CUmodule, ::CUmodule>::value, "CUmodule");
static_assert(std::is_same<tutel::cuda::CUfunction, ::CUfunction>::value, "CUfunction");
static_assert(std::is_same<tutel::cuda::CUstream, ::CUstream>::value, "CUstream");
static_assert(std::is_same<tutel::cuda::CUdeviceptr, ::CUdeviceptr>::value, "CUdeviceptr");
static_assert(std::is_same<tutel::cuda::CUdevice, ::CUdevice>::value, "CUdevice");
static_assert(std::is_same<tutel::cuda::nvrtc_api::Program, ::nvrtcProgram>::value, "nvrtcProgram");
static_assert(api::kSuccess == CUDA_SUCCESS, "CUDA_SUCCESS");
static_assert(api::kAttributeMultiprocessorCount == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count");
static_assert(api::kAttributeComputeCapabilityMajor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "major");
static_assert(api::kAttributeComputeCapabilityMinor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "minor");
static_assert(api::kCaptureStatusNone == CU_STREAM_CAPTURE_STATUS_NONE, "capture status");
static_assert(api::kCaptureModeRelaxed == CU_STREAM_CAPTURE_MODE_RELAXED, "capture mode");
static_assert(api::kHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE, "portable");
static_assert(api::kHostAllocDeviceMap == CU_MEMHOSTALLOC_DEVICEMAP, "devicemap");
static_assert(api::kJitErrorLogBuffer == CU_JIT_ERROR_LOG_BUFFER, "log buffer");
static_assert(api::kJitErrorLogBufferSizeBytes == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, "log size");

}  // namespace
