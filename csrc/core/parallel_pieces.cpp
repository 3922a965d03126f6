#include "parallel.h"

#include <algorithm>

namespace tutel {
namespace core {

int64_t useful_pieces(int64_t n, int64_t min_items_per_piece) {
  if (n <= 0) return 1;
  int64_t by_size = std::max<int64_t>(1, n / std::max<int64_t>(1, min_items_per_piece));
  return std::max<int64_t>(1, std::min<int64_t>(by_size, max_parallelism()));
}

void parallel_pieces(int64_t n, int64_t parts,
                     const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  if (parts <= 1) {
    fn(0, 0, n);
    return;
  }
  parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) fn(p, n * p / parts, n * (p + 1) / parts);
  });
}

}  // namespace core
}  // namespace tutel
