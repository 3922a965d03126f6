#include "cumsum.h"

#include <vector>

#include "parallel.h"

namespace tutel {
namespace core {

template <class In, class Out>
void cumsum_sub_one(const In* x, int64_t rows, int64_t cols, Out* out) {
  if (rows <= 0 || cols <= 0) return;
  // Pieces of consecutive rows: each piece sums its columns, the sums become
  // per-piece starting values, then every piece scans independently.  Rows are
  // walked in memory order so the inner loop over columns vectorises.
  const int64_t pieces = useful_pieces(rows * cols, 1 << 16);
  std::vector<Out> start(pieces * cols, Out(0));

  if (pieces > 1) {
    parallel_pieces(rows, pieces, [&](int64_t p, int64_t first, int64_t last) {
      Out* sum = start.data() + p * cols;
      for (int64_t r = first; r < last; ++r) {
        const In* row = x + r * cols;
        for (int64_t c = 0; c < cols; ++c) sum[c] += Out(row[c]);
      }
    });
  }
  // Exclusive scan over pieces, starting from -1.
  for (int64_t c = 0; c < cols; ++c) {
    Out running = Out(-1);
    for (int64_t p = 0; p < pieces; ++p) {
      Out piece_sum = start[p * cols + c];
      start[p * cols + c] = running;
      running += piece_sum;
    }
  }
  parallel_pieces(rows, pieces, [&](int64_t p, int64_t first, int64_t last) {
    std::vector<Out> running(start.begin() + p * cols, start.begin() + (p + 1) * cols);
    for (int64_t r = first; r < last; ++r) {
      const In* row = x + r * cols;
      Out* dst = out + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        running[c] += Out(row[c]);
        dst[c] = running[c];
      }
    }
  });
}

template void cumsum_sub_one<bool, int64_t>(const bool*, int64_t, int64_t, int64_t*);
template void cumsum_sub_one<uint8_t, int64_t>(const uint8_t*, int64_t, int64_t, int64_t*);
template void cumsum_sub_one<int8_t, int64_t>(const int8_t*, int64_t, int64_t, int64_t*);
template void cumsum_sub_one<int16_t, int64_t>(const int16_t*, int64_t, int64_t, int64_t*);
template void cumsum_sub_one<int32_t, int64_t>(const int32_t*, int64_t, int64_t, int64_t*);
template void cumsum_sub_one<int64_t, int64_t>(const int64_t*, int64_t, int64_t, int64_t*);
template void cumsum_sub_one<int32_t, int32_t>(const int32_t*, int64_t, int64_t, int32_t*);
template void cumsum_sub_one<float, float>(const float*, int64_t, int64_t, float*);
template void cumsum_sub_one<double, double>(const double*, int64_t, int64_t, double*);

}  // namespace core
}  // namespace tutel
