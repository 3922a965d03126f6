// What the tests of the expert kernels (grouped_rows_gemm.cu, decode_experts.cu) share: a value
// of the variant's data type as long double, and the rounding bounds of the accumulation and data
// types that their comparisons with a long double loop allow.  Included after the kernel source.
#pragma once

#include <cstring>

#include "core/scalar.h"
#include "variant_types.h"

namespace kernels_on_cpu {

inline long double value_of(storage_t v) {
  CoreT c;
  std::memcpy(&c, &v, sizeof(c));
  return tutel::core::Scalar<CoreT>::load(c);
}

// The unit roundoff of the accumulation type, of the data type, and the absolute error of rounding
// a subnormal float16 (half its spacing, 2^-24).
constexpr long double kAccEps = sizeof(acc_t) == 8 ? 0x1p-53L : 0x1p-24L;
#if defined(TUTEL_DTYPE_BFLOAT16)
constexpr long double kDataEps = 0x1p-8L, kDataTiny = 0;
#elif defined(TUTEL_DTYPE_FLOAT16)
constexpr long double kDataEps = 0x1p-11L, kDataTiny = 0x1p-25L;
#else
constexpr long double kDataEps = kAccEps, kDataTiny = 0;
#endif

}  // namespace kernels_on_cpu
