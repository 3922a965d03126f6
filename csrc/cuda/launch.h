// Launching a kernel with cuLaunchKernel.  The arguments' C++ types must be
// exactly the kernel's parameter types (int64_t for i64, pointers for
// pointers, TutelErrorSink by value): the driver copies each parameter's size
// from the address given.
#pragma once

#include <cstdint>
#include <string>

#include "../../kernels/kernel_abi.h"
#include "driver.h"
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

}  // namespace cuda
}  // namespace tutel
