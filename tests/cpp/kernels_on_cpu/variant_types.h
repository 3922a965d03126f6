// csrc/core's element type for the dtype variant a kernel source is built in (the kernels see
// only `storage_t`, the raw bits), and the conversion of test values into those bits. Included
// after the kernel sources, which define storage_t and acc_t.
#pragma once

#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "core/scalar.h"

namespace kernels_on_cpu {

#if defined(TUTEL_DTYPE_FLOAT16)
using CoreT = tutel::core::float16;
inline storage_t storage_of(float v) { return tutel::core::float_to_fp16(v).bits; }
#elif defined(TUTEL_DTYPE_BFLOAT16)
using CoreT = tutel::core::bfloat16;
inline storage_t storage_of(float v) { return tutel::core::float_to_bf16(v).bits; }
#else
using CoreT = storage_t;
inline storage_t storage_of(float v) { return storage_t(v); }
#endif
static_assert(sizeof(CoreT) == sizeof(storage_t), "the core reads the kernels' layout");

// n values, multiples of 1/4 in [-quarters / 4, quarters / 4] (many exact ties), and with
// special_range > 0 NaN, -0, +inf and -inf each with probability 1 / (special_range + 1).
template <class Rng>
std::vector<storage_t> tied_values(size_t n, int quarters, int special_range, Rng& rng) {
  std::uniform_int_distribution<int> quarter(-quarters, quarters), special(0, special_range > 0 ? special_range : 0);
  std::vector<storage_t> values(n);
  for (auto& value : values) {
    float v = float(quarter(rng)) / 4;
    if (special_range > 0) {
      switch (special(rng)) {
        case 0: v = std::numeric_limits<float>::quiet_NaN(); break;
        case 1: v = -0.0f; break;
        case 2: v = std::numeric_limits<float>::infinity(); break;
        case 3: v = -std::numeric_limits<float>::infinity(); break;
        default: break;
      }
    }
    value = storage_of(v);
  }
  return values;
}
static_assert(std::is_same<acc_t, tutel::core::acc_t<CoreT>>::value, "kernels and core accumulate alike");

}  // namespace kernels_on_cpu
