// CUDA programs compiled with NVRTC on first use and kept per device.
//
// A program is a source text with its headers and NVRTC options.  For each
// device it is compiled for the device's architecture (compile_target.h),
// cached in memory and on disk (kernel_cache.h, keyed by everything the
// binary depends on), and loaded into the device's primary context.  A cached
// binary the driver rejects is compiled afresh once before giving up.
#pragma once

#include <array>
#include <atomic>
#include <string>
#include <vector>

#include "driver_api.h"
#include "nvrtc.h"

namespace tutel {
namespace cuda {

constexpr int kMaxKernelDevices = 64;

struct ProgramSource {
  std::string name;  // for messages, e.g. "dispatch.cu [TUTEL_DTYPE_FLOAT16]"
  SourceFile main;
  std::vector<SourceFile> headers;
  std::vector<std::string> options;  // without the architecture
};

// The embedded kernels/<file> compiled with the options of
// kernels/nvrtc_options.txt plus -D<variant> (none when variant is empty);
// every embedded header is available to #include.
ProgramSource embedded_program(const std::string& file, const std::string& variant);

// The module of `program` on `device`, whose primary context must be current.
// Thread-safe; compiles and loads on the first call per (device, program).
CUmodule load_program(int device, const ProgramSource& program);

// The kernel `function` of a loaded module; throws naming the program if absent.
CUfunction module_function(CUmodule module, const char* function, const std::string& program);

// The on-disk cache directory in use ("" when disabled).
std::string kernel_cache_directory();

// Problems that do not stop a kernel from running (the disk cache cannot be
// written, PTX is used for a GPU newer than NVRTC) go to this handler, once
// per message; the default prints to stderr.
void set_warning_handler(void (*handler)(const std::string&));

// One kernel of an embedded program variant, resolved per device on first
// use and then served from a lock-free table.  Meant to be a static.
class KernelHandle {
 public:
  KernelHandle(const char* file, const char* variant, const char* function)
      : file_(file), variant_(variant), function_(function) {}

  // The function on `device` (primary context current).
  CUfunction get(int device) const;

 private:
  const char* file_;
  const char* variant_;
  const char* function_;
  mutable std::array<std::atomic<CUfunction>, kMaxKernelDevices> resolved_{};
};

}  // namespace cuda
}  // namespace tutel
