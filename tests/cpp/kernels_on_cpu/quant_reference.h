// The quantized weight formats as their specifications define them (OCP MX v1.0 for E2M1 and
// E8M0, OCP 8-bit floating point for E4M3), for the long double references of the tests of the
// kernels that read quantized stacks (quantized_decode.cu, quantized_grouped_linear.cu): each
// code's value, and a stack [E, rows, cols] in one of expert_abi.h's TUTEL_QUANT_* formats with its
// value at (e, n, c).  Included after the kernel source (the format numbers).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kernels_on_cpu {

// The values of the codes, from the specifications (OCP MX v1.0, OCP 8-bit floating point).
inline long double e2m1(unsigned code) {
  const long double magnitudes[8] = {0, 0.5L, 1, 1.5L, 2, 3, 4, 6};
  return (code & 8u) ? -magnitudes[code & 7u] : magnitudes[code & 7u];
}
inline long double e8m0(unsigned s) { return std::ldexp(1.0L, int(s) - 127); }
inline long double e4m3(unsigned b) {
  const int exponent = (b >> 3) & 15, mantissa = b & 7;
  const long double magnitude = exponent == 0 ? std::ldexp((long double)mantissa, -9)
                                              : std::ldexp(8.0L + mantissa, exponent - 10);
  return (b & 0x80u) ? -magnitude : magnitude;
}

// One stack [E, rows, cols] in the case's format, with its value at (e, n, c).
struct Stack {
  int format = 0;
  int64_t experts = 0, rows = 0, cols = 0, block_rows = 1, block_cols = 1;
  std::vector<uint8_t> codes, byte_scales;
  std::vector<float> float_scales, global;

  int64_t code_bytes() const { return format == TUTEL_QUANT_FP8_BLOCK ? cols : cols / 2; }
  long double value(int64_t e, int64_t n, int64_t c) const {
    if (format == TUTEL_QUANT_FP8_BLOCK) {
      const int64_t block_row_count = (rows + block_rows - 1) / block_rows;
      const int64_t per_row = (cols + block_cols - 1) / block_cols;
      const long double scale = float_scales[(e * block_row_count + n / block_rows) * per_row + c / block_cols];
      return e4m3(codes[(e * rows + n) * cols + c]) * scale;
    }
    const uint8_t byte = codes[(e * rows + n) * (cols / 2) + c / 2];
    const unsigned code = (c % 2 == 0) ? (byte & 15u) : (byte >> 4);  // the even element: the low nibble
    if (format == TUTEL_QUANT_MXFP4) return e2m1(code) * e8m0(byte_scales[(e * rows + n) * (cols / 32) + c / 32]);
    return e2m1(code) * e4m3(byte_scales[(e * rows + n) * (cols / 16) + c / 16]) * (long double)global[e];
  }
};

// Random codes and scales whose products with unit-sized activations stay near 1.
inline Stack random_stack(int format, int64_t experts, int64_t rows, int64_t cols, int64_t block_rows,
                          int64_t block_cols, std::mt19937& rng) {
  Stack s;
  s.format = format;
  s.experts = experts;
  s.rows = rows;
  s.cols = cols;
  s.block_rows = block_rows;
  s.block_cols = block_cols;
  std::uniform_int_distribution<int> byte(0, 255);
  const int64_t n = experts * rows * s.code_bytes();
  s.codes.resize(size_t(n));
  // Shifts of the scales that keep a row's dot product with unit activations near 1.
  const int shift = int(std::lround(std::log2(std::sqrt(double(cols)))));
  if (format == TUTEL_QUANT_FP8_BLOCK) {
    // E4M3 values up to 2^2 (exponent fields 0 to 8: subnormals included), either sign.
    std::uniform_int_distribution<int> exponent(0, 8), mantissa(0, 7), sign(0, 1);
    for (auto& b : s.codes) b = uint8_t((sign(rng) << 7) | (exponent(rng) << 3) | mantissa(rng));
    const int64_t blocks = experts * ((rows + block_rows - 1) / block_rows) * ((cols + block_cols - 1) / block_cols);
    std::uniform_real_distribution<float> scale(0.5f, 2.0f);
    for (int64_t q = 0; q < blocks; ++q) s.float_scales.push_back(std::ldexp(scale(rng), -shift));
  } else {
    for (auto& b : s.codes) b = uint8_t(byte(rng));  // every nibble, both signs
    if (format == TUTEL_QUANT_MXFP4) {
      std::uniform_int_distribution<int> exponent(124 - shift, 127 - shift);
      s.byte_scales.resize(size_t(experts * rows * (cols / 32)));
      for (auto& b : s.byte_scales) b = uint8_t(exponent(rng));
    } else {
      // E4M3 scales 0.25 to 3.75 (exponent fields 5 to 8), a global scale 2^-shift / 4 or so.
      std::uniform_int_distribution<int> exponent(5, 8), mantissa(0, 7);
      s.byte_scales.resize(size_t(experts * rows * (cols / 16)));
      for (auto& b : s.byte_scales) b = uint8_t((exponent(rng) << 3) | mantissa(rng));
      std::uniform_real_distribution<float> global(0.15f, 0.35f);
      for (int64_t e = 0; e < experts; ++e) s.global.push_back(std::ldexp(global(rng), -shift));
    }
  }
  return s;
}

}  // namespace kernels_on_cpu
