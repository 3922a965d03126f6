// Steps of 32 values of quantized matrix rows decoded in AVX-512 registers, as the format defines
// W (quant_codes.h): what the quantized products (quantized_products.h) decode their strips
// with, into float32 strips (quantized_products_avx512.cpp) or bfloat16 tiles
// (quantized_tiles_amx.cpp).  The codes are read with core/quant_codes_avx512.h.
#pragma once

#include "../core/quant_codes_avx512.h"
#include "../core/quantized_decode.h"

#ifdef TUTEL_HAVE_AVX2_KERNELS
#include <algorithm>
#include <cstring>

namespace tutel {
namespace gemm {
namespace quantized_steps {

// Where one row's codes and scales are, found once per row (the steps then only add offsets).
struct RowCursor {
  const uint8_t* codes;
  const uint8_t* byte_scales;  // mxfp4, nvfp4
  const float* float_scales;   // fp8_block: the row's block row
  float global;                // nvfp4's global scale, else 1
};

inline RowCursor row_cursor(const core::QuantizedMatrix& m, int64_t expert, int64_t row) {
  RowCursor c{m.row_codes(expert, row), nullptr, nullptr, m.global_scale(expert)};
  if (m.format == core::QuantFormat::kFp8Block) {
    c.float_scales = m.row_float_scales(expert, row);
  } else {
    c.byte_scales = m.row_byte_scales(expert, row);
  }
  return c;
}

// What a step of 32 values at k needs beyond the row, the same for every row: its values (fewer
// than 32 only at the end of a row) and, for fp8_block, the scale blocks they fall in: one, or
// (blocks narrower than 32 or not a multiple of it) one per value.
struct Step {
  int64_t k;
  int count;
  int64_t block;         // fp8_block: the block of value k
  bool crossing;         // fp8_block: the values fall in more than one block
  __m512i lane_block[2];  // fp8_block, crossing: the block of each value (the last one's past count)
};

TUTEL_AVX512_QUANT inline Step step_at(const core::QuantizedMatrix& m, int64_t k) {
  Step step;
  step.k = k;
  step.count = int(std::min<int64_t>(32, m.cols - k));
  step.block = k / m.block_cols;
  step.crossing = m.format == core::QuantFormat::kFp8Block && (k + step.count - 1) / m.block_cols != step.block;
  if (step.crossing) {
    alignas(64) int32_t blocks[32];
    for (int i = 0; i < 32; ++i) blocks[i] = int32_t((k + std::min(i, step.count - 1)) / m.block_cols);
    step.lane_block[0] = _mm512_load_si512(blocks);
    step.lane_block[1] = _mm512_load_si512(blocks + 16);
  }
  return step;
}

// W[row, k .. k + 32) of the format F as floats (w[0]: the first 16), zero from m.cols on.
// mxfp4: code * 2^(s - 127), exact; nvfp4: code * (scale * global), the scale product rounded to
// float32 once; fp8_block: code * the scale of each value's block (exact unless the product leaves
// float32's range).  `tables` is core::byte_tables().
template <core::QuantFormat F>
TUTEL_AVX512_QUANT inline __attribute__((always_inline)) void decode_step(const core::ByteTables& tables,
                                                                          const RowCursor& row, const Step& step,
                                                                          __m512 (&w)[2]) {
  using namespace core::avx512_codes;
  const int64_t k = step.k;
  if (F == core::QuantFormat::kMxfp4) {  // cols a multiple of 32: one whole block
    const float scale = tables.e8m0[row.byte_scales[k / core::kMxfp4Block]];
    e2m1_32(row.codes + k / 2, _mm512_mul_ps(e2m1_table(), _mm512_set1_ps(scale)), w);
  } else if (F == core::QuantFormat::kNvfp4) {  // cols a multiple of 16: two blocks, or a last one alone
    const uint8_t* scales = row.byte_scales + k / core::kNvfp4Block;
    if (step.count == 32) {
      e2m1_32(row.codes + k / 2, e2m1_table(), w);
      w[1] = _mm512_mul_ps(w[1], _mm512_set1_ps(tables.e4m3[scales[1]] * row.global));
    } else {  // 8 bytes: the other 8 read as code 0, and their values set to zero
      uint8_t part[16] = {0};
      std::memcpy(part, row.codes + k / 2, core::kNvfp4Block / 2);
      e2m1_32(part, e2m1_table(), w);
      w[1] = _mm512_setzero_ps();
    }
    w[0] = _mm512_mul_ps(w[0], _mm512_set1_ps(tables.e4m3[scales[0]] * row.global));
  } else {  // fp8_block: e4m3_32 gives the values times 2^-8, which the scales take back
    e4m3_32(row.codes + k, step.count, w);
    if (!step.crossing) {
      const __m512 scale = _mm512_set1_ps(row.float_scales[step.block] * 256.0f);
      w[0] = _mm512_mul_ps(w[0], scale);
      w[1] = _mm512_mul_ps(w[1], scale);
    } else {
      const __m512 times = _mm512_set1_ps(256.0f);
      w[0] = _mm512_mul_ps(w[0], _mm512_mul_ps(_mm512_i32gather_ps(step.lane_block[0], row.float_scales, 4), times));
      w[1] = _mm512_mul_ps(w[1], _mm512_mul_ps(_mm512_i32gather_ps(step.lane_block[1], row.float_scales, 4), times));
    }
  }
}

}  // namespace quantized_steps
}  // namespace gemm
}  // namespace tutel
#endif
