// Quantized expert rows: the code tables against the formats' definitions computed here
// independently (bit fields and powers of two in double), and the portable, AVX2 and AVX-512
// row-dot kernels (those this CPU has) against double sums of the rows decoded element by element, for
// every format, one and two rows, one to seventeen vectors, row lengths that end on partial blocks and
// off the 8-element steps, and prefetching on or off.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "core/quantized_decode.h"

using namespace tutel::core;

namespace {

double e4m3_definition(int b) {
  const int sign = b >> 7, exponent = (b >> 3) & 15, mantissa = b & 7;
  if (exponent == 15 && mantissa == 7) return std::nan("");
  const double magnitude = exponent == 0 ? mantissa / 8.0 * std::pow(2.0, -6)
                                         : (1 + mantissa / 8.0) * std::pow(2.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

TEST(QuantCodes, TablesMatchTheDefinitions) {
  const ByteTables& tables = byte_tables();
  for (int b = 0; b < 256; ++b) {
    const double want = e4m3_definition(b);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(tables.e4m3[b])) << b;
    } else {
      EXPECT_EQ(double(tables.e4m3[b]), want) << b;
    }
    if (b == 255) {
      EXPECT_TRUE(std::isnan(tables.e8m0[b]));
    } else {
      EXPECT_EQ(double(tables.e8m0[b]), std::pow(2.0, b - 127)) << b;
    }
  }
  EXPECT_EQ(e4m3_definition(0x7e), 448.0);  // the largest finite E4M3 value
  const double magnitudes[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(double(tables.e2m1[c]), (c & 8 ? -1 : 1) * magnitudes[c & 7]) << c;
}

// A random stack [E, N, K] of a format and its values in double, decoded here element by element.
struct RandomStack {
  QuantizedMatrix m;
  std::vector<uint8_t> codes, byte_scales;
  std::vector<float> float_scales, global_scales;

  RandomStack(QuantFormat format, int64_t experts, int64_t rows, int64_t cols, int64_t block_rows,
              int64_t block_cols, std::mt19937& rng) {
    m.format = format;
    m.rows = rows;
    m.cols = cols;
    m.block_rows = block_rows;
    m.block_cols = block_cols;
    codes.resize(size_t(experts * rows * m.code_bytes_per_row()));
    for (auto& c : codes) {
      c = uint8_t(rng());
      if (format == QuantFormat::kFp8Block && (c & 0x7f) == 0x7f) c = 0x30;  // no NaN codes
    }
    m.codes = codes.data();
    if (format == QuantFormat::kFp8Block) {
      float_scales.resize(size_t(experts * ((rows + block_rows - 1) / block_rows) * m.scale_blocks_per_row()));
      for (auto& s : float_scales) s = float(std::ldexp(1.0 + (rng() % 1000) / 1000.0, -8));
      m.float_scales = float_scales.data();
    } else {
      byte_scales.resize(size_t(experts * rows * m.scale_blocks_per_row()));
      // E8M0 around 2^-3; E4M3 between 2^-3 and 2^1.
      for (auto& s : byte_scales) {
        s = uint8_t(format == QuantFormat::kMxfp4 ? 122 + rng() % 4 : (4 + rng() % 5) << 3 | rng() % 8);
      }
      m.byte_scales = byte_scales.data();
    }
    if (format == QuantFormat::kNvfp4) {
      for (int64_t e = 0; e < experts; ++e) global_scales.push_back(0.25f + 0.125f * float(e));
      m.global_scales = global_scales.data();
    }
  }

  double value(int64_t expert, int64_t row, int64_t k) const {
    const uint8_t* row_codes = m.row_codes(expert, row);
    if (m.format == QuantFormat::kFp8Block) {
      return e4m3_definition(row_codes[k]) * m.row_float_scales(expert, row)[k / m.block_cols];
    }
    const int code = k & 1 ? row_codes[k / 2] >> 4 : row_codes[k / 2] & 15;
    const double magnitudes[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    const double v = (code & 8 ? -1 : 1) * magnitudes[code & 7];
    const uint8_t s = m.row_byte_scales(expert, row)[k / (m.format == QuantFormat::kMxfp4 ? 32 : 16)];
    if (m.format == QuantFormat::kMxfp4) return v * std::pow(2.0, int(s) - 127);
    return v * e4m3_definition(s) * m.global_scale(expert);
  }
};

void check_kernels(const QuantKernels& kernels) {
  std::mt19937 rng(7);
  struct Case {
    QuantFormat format;
    int64_t cols, block_rows, block_cols;
  };
  const Case cases[] = {{QuantFormat::kMxfp4, 32, 1, 1},       {QuantFormat::kMxfp4, 96, 1, 1},
                        {QuantFormat::kNvfp4, 16, 1, 1},       {QuantFormat::kNvfp4, 48, 1, 1},
                        {QuantFormat::kFp8Block, 200, 128, 128}, {QuantFormat::kFp8Block, 37, 2, 24},
                        {QuantFormat::kFp8Block, 5, 3, 2},      {QuantFormat::kFp8Block, 32, 1, 28},
                        {QuantFormat::kFp8Block, 64, 2, 24},     {QuantFormat::kFp8Block, 80, 4, 48}};
  for (const Case& c : cases) {
    const int64_t experts = 3, rows = 7;
    RandomStack stack(c.format, experts, rows, c.cols, c.block_rows, c.block_cols, rng);
    const int64_t padded = (c.cols + kQuantVectorPadding - 1) / kQuantVectorPadding * kQuantVectorPadding;
    for (int64_t rows_ahead : {int64_t(0), int64_t(8)}) {
      stack.m = prefetching(stack.m, rows_ahead);
      for (int count = 1; count <= 17; ++count) {
        // Each vector zero up to its padding, then NaN: a kernel reading past the padding gives NaN.
        const int64_t stride = padded + 16;
        std::vector<float> x(size_t(count * stride), std::nanf(""));
        std::vector<const float*> vectors;
        std::normal_distribution<float> normal;
        for (int v = 0; v < count; ++v) {
          for (int64_t k = 0; k < padded; ++k) x[size_t(v * stride + k)] = k < c.cols ? normal(rng) : 0.0f;
          vectors.push_back(x.data() + v * stride);
        }
        for (int row_count = 1; row_count <= 2; ++row_count) {
          const int64_t expert = 2, picked[2] = {5, 2};  // rows in either order, not adjacent
          std::vector<float> out(size_t(row_count * count));
          kernels.dots(stack.m, expert, picked, row_count, vectors.data(), count, out.data());
          for (int r = 0; r < row_count; ++r) {
            for (int v = 0; v < count; ++v) {
              double want = 0, scale = 0;
              for (int64_t k = 0; k < c.cols; ++k) {
                const double term = stack.value(expert, picked[r], k) * double(vectors[size_t(v)][k]);
                want += term;
                scale += std::fabs(term);
              }
              EXPECT_NEAR(out[size_t(r * count + v)], want, double(c.cols + 4) * std::ldexp(scale, -24) + 1e-30)
                  << kernels.name << " format " << int(c.format) << " cols " << c.cols << " row " << r << " vector "
                  << v << " of " << count;
            }
          }
        }
      }
    }
  }
}

// Where element k of a vector lies in the bfloat16 layout of `format`, from the layouts'
// definitions: mxfp4 rounds of 128 elements hold elements 0, 4, 8, ..., then 1, 5, 9, ..., then
// 2, 6, ... and 3, 7, ...; fp8_block rounds of 64 hold their 8-element groups 0, 2, 4, 6, then 1, 3,
// 5, 7.
int64_t bf16_layout_position(QuantFormat format, int64_t k) {
  if (format == QuantFormat::kMxfp4) {
    const int64_t round = k / 128 * 128, j = k - round;
    return round + (j % 4) * 32 + j / 4;
  }
  const int64_t round = k / 64 * 64, j = k - round;
  return round + (j / 8 % 2) * 32 + (j / 16) * 8 + j % 8;
}

// `count` random vectors of `cols` bfloat16 values: their values, and their bits in the bfloat16
// layout of `format` (zeros past cols, up to a multiple of kQuantBf16Padding).
struct Bf16Vectors {
  std::vector<std::vector<double>> values;
  std::vector<uint16_t> bits;
  std::vector<const uint16_t*> vectors;
  int64_t width;  // elements from one vector's bits to the next's

  Bf16Vectors(QuantFormat format, int64_t cols, int count, std::mt19937& rng)
      : width((cols + kQuantBf16Padding - 1) / kQuantBf16Padding * kQuantBf16Padding) {
    values.assign(size_t(count), std::vector<double>(size_t(cols), 0.0));
    bits.assign(size_t(count * width), 0);
    std::normal_distribution<float> normal;
    for (int v = 0; v < count; ++v) {
      for (int64_t k = 0; k < cols; ++k) {
        float f = normal(rng);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        u &= 0xffff0000u;  // truncated to a bfloat16 value
        std::memcpy(&f, &u, 4);
        values[size_t(v)][size_t(k)] = f;
        bits[size_t(v * width + bf16_layout_position(format, k))] = uint16_t(u >> 16);
      }
    }
    for (int v = 0; v < count; ++v) vectors.push_back(bits.data() + v * width);
  }
};

// The double sum of row `row` of `expert` times vector v's values, and the sum of the terms' magnitudes.
std::pair<double, double> double_dot(const RandomStack& stack, int64_t expert, int64_t row, const Bf16Vectors& x,
                                     int v) {
  double want = 0, scale = 0;
  for (int64_t k = 0; k < stack.m.cols; ++k) {
    const double term = stack.value(expert, row, k) * x.values[size_t(v)][size_t(k)];
    want += term;
    scale += std::fabs(term);
  }
  return {want, scale};
}

// bf16_dots with bfloat16 vectors in the bfloat16 layouts against the same double sums of the
// vectors' values, for rows of whole rounds and of one to three scale blocks past them (mxfp4),
// partial last blocks (fp8_block), one to nine vectors, one to four rows.  FP8 blocks of 32 or 96
// columns are not whole rounds and go to the float32 kernels.
void check_bf16_kernels(const QuantKernels& kernels) {
  ASSERT_NE(kernels.bf16_dots, nullptr);
  std::mt19937 rng(11);
  struct Case {
    QuantFormat format;
    int64_t cols, block_rows, block_cols;
  };
  const Case cases[] = {{QuantFormat::kMxfp4, 32, 1, 1},          {QuantFormat::kMxfp4, 64, 1, 1},
                        {QuantFormat::kMxfp4, 96, 1, 1},          {QuantFormat::kMxfp4, 128, 1, 1},
                        {QuantFormat::kMxfp4, 160, 1, 1},         {QuantFormat::kMxfp4, 352, 1, 1},
                        {QuantFormat::kMxfp4, 2880, 1, 1},        {QuantFormat::kFp8Block, 200, 128, 128},
                        {QuantFormat::kFp8Block, 96, 3, 64},      {QuantFormat::kFp8Block, 130, 2, 64},
                        {QuantFormat::kFp8Block, 7, 1, 64},       {QuantFormat::kFp8Block, 300, 5, 192}};
  for (int64_t block_cols : {32, 96}) {
    RandomStack stack(QuantFormat::kFp8Block, 1, 2, 96, 1, block_cols, rng);
    EXPECT_FALSE(bf16_takes(stack.m)) << block_cols;
  }
  for (const Case& c : cases) {
    const int64_t experts = 3, rows = 7, cols = c.cols;
    RandomStack stack(c.format, experts, rows, cols, c.block_rows, c.block_cols, rng);
    ASSERT_TRUE(bf16_takes(stack.m));
    for (int64_t rows_ahead : {int64_t(0), int64_t(8)}) {
      stack.m = prefetching(stack.m, rows_ahead);
      for (int count = 1; count <= 9; ++count) {
        const Bf16Vectors x(c.format, cols, count, rng);
        for (int row_count = 1; row_count <= kQuantMaxRows; ++row_count) {
          const int64_t expert = 1, picked[kQuantMaxRows] = {6, 3, 4, 0};
          std::vector<float> out(size_t(row_count * count));
          kernels.bf16_dots(stack.m, expert, picked, row_count, x.vectors.data(), count, out.data());
          for (int r = 0; r < row_count; ++r) {
            for (int v = 0; v < count; ++v) {
              const auto [want, scale] = double_dot(stack, expert, picked[r], x, v);
              EXPECT_NEAR(out[size_t(r * count + v)], want, double(cols + 4) * std::ldexp(scale, -24) + 1e-30)
                  << kernels.name << " format " << int(c.format) << " cols " << cols << " row " << r << " vector " << v
                  << " of " << count;
            }
          }
        }
      }
    }
  }
}

// E8M0 scales at the ends of their range through bf16_dots: exponent bytes 0 to 3 (2^-127, below
// float32's normal range, to 2^-124) give the double sums, compared without an absolute slack;
// byte 255 (NaN), in a whole round or in the row's last blocks, makes that row's sums NaN and
// leaves the other row's alone.  The NaN block's codes are all 1.0 and the vectors positive there,
// so that a kernel that took byte 255 for infinity would sum +infinity, not NaN.
void check_bf16_mxfp4_scale_ends(const QuantKernels& kernels) {
  std::mt19937 rng(13);
  const int64_t cols = 2880 + 96;  // 23 whole rounds and three blocks
  for (int64_t nan_block : {int64_t(-1), int64_t(5), int64_t(cols / 32 - 1)}) {
    RandomStack stack(QuantFormat::kMxfp4, 1, 2, cols, 1, 1, rng);
    for (int64_t b = 0; b < stack.m.scale_blocks_per_row(); ++b) {
      stack.byte_scales[size_t(b)] = uint8_t(b % 4);
      if (b == nan_block) stack.byte_scales[size_t(stack.m.scale_blocks_per_row() + b)] = 255;
    }
    if (nan_block >= 0) {
      for (int64_t i = 0; i < 16; ++i) stack.codes[size_t(cols / 2 + nan_block * 16 + i)] = 0x22;  // 1.0, 1.0
    }
    for (int count = 1; count <= 2; ++count) {
      Bf16Vectors x(QuantFormat::kMxfp4, cols, count, rng);
      for (int v = 0; v < count && nan_block >= 0; ++v) {
        for (int64_t k = nan_block * 32; k < nan_block * 32 + 32; ++k) {
          x.values[size_t(v)][size_t(k)] = std::fabs(x.values[size_t(v)][size_t(k)]);
          x.bits[size_t(v * x.width + bf16_layout_position(QuantFormat::kMxfp4, k))] &= 0x7fff;
        }
      }
      const int64_t picked[2] = {0, 1};
      std::vector<float> out(size_t(2 * count));
      kernels.bf16_dots(stack.m, 0, picked, 2, x.vectors.data(), count, out.data());
      for (int v = 0; v < count; ++v) {
        const auto [want, scale] = double_dot(stack, 0, 0, x, v);
        EXPECT_NEAR(out[size_t(v)], want, double(cols + 4) * std::ldexp(scale, -24)) << "vector " << v;
        if (nan_block >= 0) {
          EXPECT_TRUE(std::isnan(out[size_t(count + v)])) << "NaN scale in block " << nan_block;
        } else {
          const auto [want_1, scale_1] = double_dot(stack, 0, 1, x, v);
          EXPECT_NEAR(out[size_t(count + v)], want_1, double(cols + 4) * std::ldexp(scale_1, -24)) << "vector " << v;
        }
      }
    }
  }
}

TEST(QuantizedDecode, PortableKernelsMatchDoubleSums) { check_kernels(portable_quant_kernels()); }

TEST(QuantizedDecode, Avx2KernelsMatchDoubleSums) {
  const QuantKernels* avx2 = avx2_quant_kernels();
  if (avx2 == nullptr) GTEST_SKIP() << "no AVX2 + FMA + F16C on this CPU or in this build";
  check_kernels(*avx2);
}

TEST(QuantizedDecode, Avx512KernelsMatchDoubleSums) {
  const QuantKernels* avx512 = avx512_quant_kernels();
  if (avx512 == nullptr) GTEST_SKIP() << "no AVX-512 (F, BW, VL) on this CPU or in this build";
  check_kernels(*avx512);
}

TEST(QuantizedDecode, Avx512Bf16KernelsMatchDoubleSums) {
  const QuantKernels* bf16 = avx512_bf16_quant_kernels();
  if (bf16 == nullptr) GTEST_SKIP() << "no AVX512-BF16 on this CPU or in this build";
  check_kernels(*bf16);
  check_bf16_kernels(*bf16);
  check_bf16_mxfp4_scale_ends(*bf16);
}

TEST(QuantizedDecode, BestKernelsAreTheWidestThisCpuRuns) {
  const QuantKernels* bf16 = avx512_bf16_quant_kernels();
  const QuantKernels* avx512 = avx512_quant_kernels();
  const QuantKernels* avx2 = avx2_quant_kernels();
  EXPECT_EQ(&best_quant_kernels(), bf16 ? bf16 : avx512 ? avx512 : avx2 ? avx2 : &portable_quant_kernels());
}

}  // namespace
