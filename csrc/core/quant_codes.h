// The element codes of quantized expert weights and their values, by the formats' specifications.
//
//   E2M1 (OCP Microscaling Formats v1.0, "FP4"): sign bit 3, two exponent bits (bias 1), one
//     mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7 (code 1 is the
//     subnormal 0.5).  No infinities, no NaN.  Two codes a byte, the even element in the low nibble.
//   E8M0 (OCP MX v1.0 scale): 2^(s - 127) for s in 0..254; 255 is NaN.
//   E4M3 "fn" (OCP 8-bit floating point, PyTorch's float8_e4m3fn): sign bit 7, four exponent bits
//     (bias 7), three mantissa bits; exponent 0 is subnormal (m / 8 * 2^-6); no infinities; 0x7f
//     and 0xff are NaN; the largest finite magnitude is 448.
//
// Every value here is exact in float32, so a table of floats is each code's value, not an
// approximation of it.  The vector kernels decode the same bits in registers
// (quantized_decode_avx2.cpp) and are tested against these tables.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace tutel {
namespace core {

// The formats of the experts' quantized weight stacks (decode_quantized_experts' `format`).
enum class QuantFormat : int {
  kMxfp4 = 0,     // E2M1 codes, one E8M0 scale per 32 elements of a row
  kNvfp4 = 1,     // E2M1 codes, one E4M3 scale per 16 elements of a row, a float32 scale per expert
  kFp8Block = 2,  // E4M3 codes, one float32 scale per (block_rows x block_cols) block of the matrix
};

// Elements per scale along a row for the fp4 formats (fp8_block takes its block as an argument).
constexpr int64_t kMxfp4Block = 32;
constexpr int64_t kNvfp4Block = 16;

// The magnitudes of E2M1 codes 0..7.
constexpr float kE2M1Magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// The value of a 4-bit E2M1 code (bits above the nibble ignored).
inline float e2m1_value(uint32_t code) {
  const float magnitude = kE2M1Magnitudes[code & 7u];
  return (code & 8u) ? -magnitude : magnitude;
}

// The value of an E8M0 scale byte.
inline float e8m0_value(uint8_t s) {
  if (s == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, int(s) - 127);  // 2^-127 is a float32 subnormal, still exact
}

// The value of an E4M3 (fn) byte.
inline float e4m3_value(uint8_t b) {
  const int exponent = (b >> 3) & 15, mantissa = b & 7;
  float magnitude;
  if (exponent == 15 && mantissa == 7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -9);  // m / 8 * 2^-6
  } else {
    magnitude = std::ldexp(float(8 + mantissa), exponent - 10);  // (1 + m / 8) * 2^(e - 7)
  }
  return (b & 0x80) ? -magnitude : magnitude;
}

// Tables of every byte's value, built once: the portable kernels and the scale lookups of the
// vector kernels read them.
struct ByteTables {
  float e4m3[256];
  float e8m0[256];
  float e2m1[16];
  ByteTables() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = e4m3_value(uint8_t(b));
      e8m0[b] = e8m0_value(uint8_t(b));
    }
    for (int c = 0; c < 16; ++c) e2m1[c] = e2m1_value(uint32_t(c));
  }
};

inline const ByteTables& byte_tables() {
  static const ByteTables tables;
  return tables;
}

}  // namespace core
}  // namespace tutel
