// NVRTC's C API, declared here so that building tutel needs no CUDA header.
// One row per function: X(name, return type, (parameter types)).  nvrtcResult
// is an int-sized enum and nvrtcProgram an opaque pointer; the declarations
// are checked against NVIDIA's nvrtc.h by tests/abi/cuda_abi_check.cpp.
#pragma once

#include <cstddef>

struct _nvrtcProgram;

namespace tutel {
namespace cuda {
namespace nvrtc_api {

using Result = int;
using Program = ::_nvrtcProgram*;

#define TUTEL_NVRTC_FUNCTIONS(X)                                                              \
  X(nvrtcGetErrorString, const char*, (Result))                                               \
  X(nvrtcVersion, Result, (int*, int*))                                                       \
  X(nvrtcGetNumSupportedArchs, Result, (int*))                                                \
  X(nvrtcGetSupportedArchs, Result, (int*))                                                   \
  X(nvrtcCreateProgram, Result,                                                               \
    (Program*, const char*, const char*, int, const char* const*, const char* const*))        \
  X(nvrtcDestroyProgram, Result, (Program*))                                                  \
  X(nvrtcCompileProgram, Result, (Program, int, const char* const*))                          \
  X(nvrtcGetPTXSize, Result, (Program, size_t*))                                              \
  X(nvrtcGetPTX, Result, (Program, char*))                                                    \
  X(nvrtcGetCUBINSize, Result, (Program, size_t*))                                            \
  X(nvrtcGetCUBIN, Result, (Program, char*))                                                  \
  X(nvrtcGetProgramLogSize, Result, (Program, size_t*))                                       \
  X(nvrtcGetProgramLog, Result, (Program, char*))

// Table of the functions, filled by dlsym.
struct Functions {
#define TUTEL_NVRTC_MEMBER(name, result, params) result(*name) params = nullptr;
  TUTEL_NVRTC_FUNCTIONS(TUTEL_NVRTC_MEMBER)
#undef TUTEL_NVRTC_MEMBER
};

}  // namespace nvrtc_api
}  // namespace cuda
}  // namespace tutel
