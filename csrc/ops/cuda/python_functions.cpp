// The CUDA helpers tutel._C exposes to Python (private names; the public API
// is tutel.cuda and tutel.jit).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "../../cuda/driver.h"
#include "../../cuda/kernel_programs.h"
#include "../../cuda/nvrtc.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

void check_errors(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cuda::make_primary_context_current(device);
  raise_data_errors(device);
}

pybind11::tuple nvrtc_info() {
  const cuda::Nvrtc& compiler = cuda::nvrtc();
  const auto version = compiler.version();
  return pybind11::make_tuple(compiler.library_path(), version.first, version.second);
}

// Compiles (or finds in the caches) a user kernel for `device`; returns its
// CUfunction as an integer for launch_function.
uintptr_t user_kernel_function(const std::string& source, const std::string& function,
                               const std::vector<std::string>& options, int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cuda::make_primary_context_current(device);
  cuda::ProgramSource program;
  program.name = "user kernel " + function;
  program.main = cuda::SourceFile{function + ".cu", source};
  program.options = options;
  const cuda::CUmodule module = cuda::load_program(device, program);
  return reinterpret_cast<uintptr_t>(cuda::module_function(module, function.c_str(), program.name));
}

// Launches on PyTorch's current stream of `device`; every argument takes a
// 64-bit slot: the tensors' addresses, then the integers.
void launch_function(uintptr_t function, int device, const std::array<int64_t, 3>& grid,
                     const std::array<int64_t, 3>& block, const std::vector<uint64_t>& pointers,
                     const std::vector<int64_t>& integers) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cuda::make_primary_context_current(device);
  std::vector<int64_t> slots;
  for (uint64_t pointer : pointers) slots.push_back(static_cast<int64_t>(pointer));
  slots.insert(slots.end(), integers.begin(), integers.end());
  std::vector<void*> params;
  for (auto& slot : slots) params.push_back(&slot);
  const auto stream = reinterpret_cast<cuda::CUstream>(c10::cuda::getCurrentCUDAStream(device).stream());
  cuda::check_driver(
      cuda::driver().cuLaunchKernel(reinterpret_cast<cuda::CUfunction>(function), unsigned(grid[0]),
                                    unsigned(grid[1]), unsigned(grid[2]), unsigned(block[0]),
                                    unsigned(block[1]), unsigned(block[2]), 0, stream,
                                    params.empty() ? nullptr : params.data(), nullptr),
      "cuLaunchKernel (tutel.jit kernel)");
}

}  // namespace

void register_python_functions(pybind11::module_& m) {
  m.def("_cuda_set_nvrtc_search_dirs", &cuda::set_nvrtc_search_dirs,
        "Directories searched first for libnvrtc (see tutel/cuda_libraries.py).");
  m.def("_cuda_check_errors", &check_errors,
        "Synchronises the device and raises the first bad index or location its kernels found.");
  m.def("_cuda_kernel_cache_dir", &cuda::kernel_cache_directory,
        "The directory of the on-disk kernel cache ('' when disabled).");
  m.def("_cuda_nvrtc_info", &nvrtc_info, "(path, major, minor) of the NVRTC in use; loads it.");
  m.def("_cuda_user_kernel_function", &user_kernel_function);
  m.def("_cuda_launch_function", &launch_function);
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
