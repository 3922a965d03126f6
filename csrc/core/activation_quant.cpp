#include "activation_quant.h"

#include <cmath>

#include "parallel.h"

namespace tutel {
namespace core {
namespace {

// transformers' floor of the scale the values are divided by.
constexpr float kSmallestDivisor = 1e-12f;
constexpr float kE4M3Max = 448.0f;

// Rows per chunk of the parallel loop: enough elements that a chunk outweighs its scheduling.
int64_t grain_rows(int64_t cols) { return cols >= 4096 ? 1 : 4096 / (cols > 0 ? cols : 1); }

}  // namespace

float e4m3_rounded(float x) {
  const uint32_t bits = float_to_bits(x), sign = bits & 0x80000000u, magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return x;  // NaN
  float rounded;
  if (magnitude >= 0x3c800000u) {
    // 2^-6 and up: normal E4M3, three mantissa bits kept; rounding on float32's bits, the discarded
    // 20 with the even tie (a carry moves on to the next binade).
    rounded = bits_to_float((magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) & 0xfff00000u);
    if (rounded > kE4M3Max) rounded = kE4M3Max;
  } else {
    // subnormal E4M3: multiples of 2^-9; the product by 2^9 is exact, nearbyint rounds ties to even
    rounded = std::nearbyint(bits_to_float(magnitude) * 512.0f) * 0x1p-9f;
  }
  return bits_to_float(float_to_bits(rounded) | sign);
}

template <class T>
void dynamic_activations(const T* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t group, float* out) {
  if (rows <= 0 || cols <= 0) return;
  parallel_for(0, rows, grain_rows(cols), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* src = x + r * x_stride;
      float* dst = out + r * cols;
      for (int64_t begin = 0; begin < cols; begin += group) {
        const int64_t end = cols - begin > group ? begin + group : cols;
        float amax = 0.0f;
        for (int64_t c = begin; c < end; ++c) {
          const float magnitude = std::fabs(Scalar<T>::load(src[c]));
          if (magnitude > amax || magnitude != magnitude) amax = magnitude;  // NaN wins
          if (amax != amax) break;
        }
        const float scale = amax / kE4M3Max;
        const float divisor = scale < kSmallestDivisor ? kSmallestDivisor : scale;  // NaN stays NaN
        for (int64_t c = begin; c < end; ++c) {
          dst[c] = e4m3_rounded(Scalar<T>::load(src[c]) / divisor) * scale;
        }
      }
    }
  });
}

template void dynamic_activations<float>(const float*, int64_t, int64_t, int64_t, int64_t, float*);
template void dynamic_activations<bfloat16>(const bfloat16*, int64_t, int64_t, int64_t, int64_t, float*);
template void dynamic_activations<float16>(const float16*, int64_t, int64_t, int64_t, int64_t, float*);

}  // namespace core
}  // namespace tutel
