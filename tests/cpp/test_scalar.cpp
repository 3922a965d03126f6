// bfloat16 / float16 conversions: exact round trips and round-to-nearest-even.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "core/scalar.h"

using namespace tutel::core;

TEST(Scalar, Fp16RoundTripsEveryBitPattern) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    float value = fp16_to_float(float16{uint16_t(bits)});
    uint16_t back = float_to_fp16(value).bits;
    if (std::isnan(value)) {
      EXPECT_EQ(back & 0x7e00u, 0x7e00u) << bits;  // stays a NaN
    } else {
      EXPECT_EQ(back, bits) << "pattern " << bits << " value " << value;
    }
  }
}

TEST(Scalar, Bf16RoundTripsEveryBitPattern) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    float value = bf16_to_float(bfloat16{uint16_t(bits)});
    uint16_t back = float_to_bf16(value).bits;
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(bfloat16{back})));
    } else {
      EXPECT_EQ(back, bits);
    }
  }
}

TEST(Scalar, RoundsHalfwayCasesToEven) {
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(fp16_to_float(float_to_fp16(std::ldexp(1.0f, -25))), 0.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(3 * std::ldexp(1.0f, -25))), std::ldexp(1.0f, -23));
  EXPECT_EQ(fp16_to_float(float_to_fp16(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_to_float(float_to_fp16(65520.0f))));
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
}

// For random floats the result must be a nearest representable value.
template <class Round, class Widen>
void expect_nearest(Round round, Widen widen, float lo, float hi) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int i = 0; i < 200000; ++i) {
    float f = dist(rng);
    uint16_t h = round(f);
    double chosen = std::fabs(double(widen(h)) - f);
    for (int step : {-1, 1}) {
      uint16_t neighbour = uint16_t(h + step);
      float n = widen(neighbour);
      if (std::isnan(n) || std::isinf(n)) continue;
      if ((neighbour & 0x8000) != (h & 0x8000)) continue;
      EXPECT_LE(chosen, std::fabs(double(n) - f)) << f;
    }
  }
}

TEST(Scalar, RandomValuesRoundToNearest) {
  expect_nearest([](float f) { return float_to_fp16(f).bits; },
                 [](uint16_t b) { return fp16_to_float(float16{b}); }, -65500.f, 65500.f);  // beyond 65520 the answer is inf (tested above)
  expect_nearest([](float f) { return float_to_fp16(f).bits; },
                 [](uint16_t b) { return fp16_to_float(float16{b}); }, -1e-4f, 1e-4f);
  expect_nearest([](float f) { return float_to_bf16(f).bits; },
                 [](uint16_t b) { return bf16_to_float(bfloat16{b}); }, -1e30f, 1e30f);
}
