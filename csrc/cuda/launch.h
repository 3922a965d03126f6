// Launching a kernel with cuLaunchKernel.  The arguments' C++ types must be
// exactly the kernel's parameter types (int64_t for i64, pointers for
// pointers, TutelErrorSink by value): the driver copies each parameter's size
// from the address given.  The operators launch through CheckedFunction, which
// compares them with the kernel's parameter list at compile time.
#pragma once

#include <cstdint>
#include <string>

#include "../../kernels/kernel_abi.h"
#include "driver.h"
#include "kernel_param_kinds.h"
#include "launch_plan.h"

namespace tutel {
namespace cuda {

template <class... Args>
void launch_kernel(CUfunction function, Grid grid, CUstream stream, const char* what,
                   Args... args) {
  if (grid_is_empty(grid)) return;  // nothing to do
  if (!grid_fits(grid))
    throw DriverError(std::string("tutel: ") + what + " needs a grid of " + std::to_string(grid.x) +
                      " x " + std::to_string(grid.y) + " blocks, more than CUDA allows");
  void* params[] = {static_cast<void*>(&args)...};
  check_driver(driver().cuLaunchKernel(function, unsigned(grid.x), unsigned(grid.y), 1,
                                       TUTEL_BLOCK_THREADS, 1, 1, 0, stream, params, nullptr),
               what);
}

// A kernel's function together with its parameter list (kernel_params.h), for the launch below.
template <class Params>
struct CheckedFunction {
  CUfunction function;
};

// launch_kernel for a function whose parameter list is known: arguments of other types than the
// kernel's parameters (an int for an i64, a bool for an int, a missing or extra one) fail to compile.
template <class Params, class... Args>
void launch_kernel(CheckedFunction<Params> kernel, Grid grid, CUstream stream, const char* what, Args... args) {
  static_assert(std::is_same<Params, ParamsOf<Args...>>::value,
                "tutel: the launch's argument types are not the kernel's parameters (csrc/cuda/kernel_params.h)");
  launch_kernel(kernel.function, grid, stream, what, args...);
}

}  // namespace cuda
}  // namespace tutel
