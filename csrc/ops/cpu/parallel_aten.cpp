// The core's threading primitive, backed by PyTorch's intra-op thread pool.
#include <ATen/Parallel.h>

#include "../../core/parallel.h"

namespace tutel {
namespace core {

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  at::parallel_for(begin, end, grain, fn);
}

int max_parallelism() { return at::get_num_threads(); }

}  // namespace core
}  // namespace tutel
