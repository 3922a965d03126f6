// Launching a kernel with cuLaunchKernel.  The arguments' C++ types must be
// exactly the kernel's parameter types (int64_t for i64, pointers for
// pointers, TutelErrorSink by value): the driver copies each parameter's size
// from the address given.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "../../kernels/kernel_abi.h"
#include "driver.h"

namespace tutel {
namespace cuda {

struct Grid {
  int64_t x = 1;
  int64_t y = 1;
};

// Blocks needed for `items` items at `per_block` items per block.
inline int64_t blocks_for(int64_t items, int64_t per_block) {
  return (items + per_block - 1) / per_block;
}

template <class... Args>
void launch_kernel(CUfunction function, Grid grid, CUstream stream, const char* what,
                   Args... args) {
  if (grid.x <= 0 || grid.y <= 0) return;  // nothing to do
  if (grid.x > std::numeric_limits<int32_t>::max() || grid.y > 65535)
    throw DriverError(std::string("tutel: ") + what + " needs a grid of " + std::to_string(grid.x) +
                      " x " + std::to_string(grid.y) + " blocks, more than CUDA allows");
  void* params[] = {static_cast<void*>(&args)...};
  check_driver(driver().cuLaunchKernel(function, unsigned(grid.x), unsigned(grid.y), 1,
                                       TUTEL_BLOCK_THREADS, 1, 1, 0, stream, params, nullptr),
               what);
}

}  // namespace cuda
}  // namespace tutel
