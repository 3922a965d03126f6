// Inclusive prefix sum down the rows of a [rows, cols] matrix, minus one:
//   out[r, c] = sum_{i <= r} x[i, c] - 1
// For a one-hot routing mask this is each token's slot inside its expert
// (GShard's "cumsum minus one"), computed in one pass without a separate
// subtraction.
#pragma once

#include <cstdint>

namespace tutel {
namespace core {

template <class In, class Out>
void cumsum_sub_one(const In* x, int64_t rows, int64_t cols, Out* out);

}  // namespace core
}  // namespace tutel
