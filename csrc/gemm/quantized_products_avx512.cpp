// The AVX-512 kernels of the float products (quantized_products.h): strips decoded 32 x 32 values
// at a time in registers and transposed on their way to the strip, and the rows multiplied eight at
// a time with the strip's 32 outputs in two registers.
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its (maybe-)uninitialized warnings
// flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "quantized_products.h"
#include "quantized_steps_avx512.h"
#include "../core/quant_codes_avx512_bf16.h"

#ifdef TUTEL_HAVE_AVX2_KERNELS
#include "avx512_lanes.h"

namespace tutel {
namespace gemm {
namespace {

constexpr int64_t kStrip = kQuantizedStripOutputs;

template <core::QuantFormat F>
TUTEL_AVX512 void decode_strip_of(const core::QuantizedMatrix& w, int64_t expert, int64_t o, float* strip) {
  const core::ByteTables& tables = core::byte_tables();
  const int64_t valid = std::max<int64_t>(0, std::min(kStrip, w.rows - o));
  quantized_steps::RowCursor rows[kStrip];
  for (int64_t j = 0; j < valid; ++j) rows[j] = quantized_steps::row_cursor(w, expert, o + j);
  // One step's 32 rows x 32 values, row-major; each 16 x 16 quarter goes out transposed.
  alignas(64) float step_values[kStrip][32];
  for (int64_t k = 0; k < w.cols; k += 32) {
    const quantized_steps::Step step = quantized_steps::step_at(w, k);
    for (int64_t j = 0; j < kStrip; ++j) {
      __m512 values[2];
      if (j < valid) {
        quantized_steps::decode_step<F>(tables, rows[j], step, values);
      } else {
        values[0] = values[1] = _mm512_setzero_ps();
      }
      _mm512_store_ps(step_values[j], values[0]);
      _mm512_store_ps(step_values[j] + 16, values[1]);
    }
    for (int64_t half = 0; half < 2 && 16 * half < step.count; ++half) {  // values k + 16 half ..
      for (int64_t quarter = 0; quarter < 2; ++quarter) {                 // outputs o + 16 quarter ..
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = _mm512_castps_si512(_mm512_load_ps(step_values[16 * quarter + i] + 16 * half));
        avx512::transpose_16x16(r);
        for (int64_t i = 0; i < std::min<int64_t>(16, step.count - 16 * half); ++i)
          _mm512_storeu_ps(strip + (k + 16 * half + i) * kStrip + 16 * quarter, _mm512_castsi512_ps(r[i]));
      }
    }
  }
}

void avx512_decode_strip(const core::QuantizedMatrix& w, int64_t expert, int64_t o, float* strip) {
  switch (w.format) {
    case core::QuantFormat::kMxfp4: return decode_strip_of<core::QuantFormat::kMxfp4>(w, expert, o, strip);
    case core::QuantFormat::kNvfp4: return decode_strip_of<core::QuantFormat::kNvfp4>(w, expert, o, strip);
    case core::QuantFormat::kFp8Block: return decode_strip_of<core::QuantFormat::kFp8Block>(w, expert, o, strip);
  }
}

template <int R>
TUTEL_AVX512 void multiply_rows(const float* x, int64_t x_stride, int64_t inner, const float* strip, __m512 bias[2],
                                float* y, int64_t y_stride, __mmask16 kept[2]) {
  __m512 sums[R][2];
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < inner; ++k) {
    const __m512 w0 = _mm512_loadu_ps(strip + k * kStrip), w1 = _mm512_loadu_ps(strip + k * kStrip + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_set1_ps(x[r * x_stride + k]);
      sums[r][0] = _mm512_fmadd_ps(v, w0, sums[r][0]);
      sums[r][1] = _mm512_fmadd_ps(v, w1, sums[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * y_stride, kept[0], _mm512_add_ps(sums[r][0], bias[0]));
    _mm512_mask_storeu_ps(y + r * y_stride + 16, kept[1], _mm512_add_ps(sums[r][1], bias[1]));
  }
}

TUTEL_AVX512 void avx512_multiply_strip(const float* x, int64_t x_stride, int64_t rows, int64_t inner,
                                        const float* strip, const float* bias, float* y, int64_t y_stride,
                                        int64_t outputs) {
  __mmask16 kept[2];
  __m512 bias_lanes[2];
  for (int half = 0; half < 2; ++half) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, outputs - 16 * half));
    kept[half] = __mmask16((uint32_t(1) << n) - 1u);
    bias_lanes[half] = bias ? _mm512_maskz_loadu_ps(kept[half], bias + 16 * half) : _mm512_setzero_ps();
  }
  constexpr int64_t kBlock = 8;  // 16 sums in registers, beside the strip's two and the broadcast
  int64_t r = 0;
  for (; r + kBlock <= rows; r += kBlock)
    multiply_rows<kBlock>(x + r * x_stride, x_stride, inner, strip, bias_lanes, y + r * y_stride, y_stride, kept);
  const float* const xr = x + r * x_stride;
  float* const yr = y + r * y_stride;
  switch (rows - r) {
    case 1: multiply_rows<1>(xr, x_stride, inner, strip, bias_lanes, yr, y_stride, kept); break;
    case 2: multiply_rows<2>(xr, x_stride, inner, strip, bias_lanes, yr, y_stride, kept); break;
    case 3: multiply_rows<3>(xr, x_stride, inner, strip, bias_lanes, yr, y_stride, kept); break;
    case 4: multiply_rows<4>(xr, x_stride, inner, strip, bias_lanes, yr, y_stride, kept); break;
    case 5: multiply_rows<5>(xr, x_stride, inner, strip, bias_lanes, yr, y_stride, kept); break;
    case 6: multiply_rows<6>(xr, x_stride, inner, strip, bias_lanes, yr, y_stride, kept); break;
    case 7: multiply_rows<7>(xr, x_stride, inner, strip, bias_lanes, yr, y_stride, kept); break;
    default: break;
  }
}

// Row by row (the strip's stores then run along its rows), each value rounded to bfloat16 once:
// E2M1 through bfloat16 tables of the scaled values; fp8_block's whole 64-value steps within one
// block through its exact bfloat16 bytes widened to float32 and scaled, and its other steps (narrow
// or partial blocks) as the float products decode them, then converted.
template <core::QuantFormat F>
TUTEL_AVX512_BF16_CODES void decode_rows_bf16_of(const core::QuantizedMatrix& w, int64_t expert, int64_t o,
                                                 int64_t count, uint16_t* out, int64_t ld) {
  using namespace core::avx512_codes;
  const core::ByteTables& tables = core::byte_tables();
  const E4m3Bf16Tables& e4m3 = e4m3_bf16_tables();
  for (int64_t j = 0; j < count; ++j) {
    const quantized_steps::RowCursor row = quantized_steps::row_cursor(w, expert, o + j);
    uint16_t* row_out = out + j * ld;
    for (int64_t k = 0; k < w.cols;) {
      __m512i values;
      const int n = int(std::min<int64_t>(32, w.cols - k));
      if (F == core::QuantFormat::kMxfp4) {  // cols a multiple of 32: one whole block
        values = e2m1_bf16_32(row.codes + k / 2, tables.e8m0[row.byte_scales[k / core::kMxfp4Block]]);
      } else if (F == core::QuantFormat::kNvfp4) {  // cols a multiple of 16: two blocks, or a last one alone
        const uint8_t* scales = row.byte_scales + k / core::kNvfp4Block;
        values = e2m1_bf16_two_blocks(row.codes + k / 2, tables.e4m3[scales[0]] * row.global,
                                      n == 32 ? tables.e4m3[scales[1]] * row.global : 0.0f, n == 32);
      } else if (k + 64 <= w.cols && k / w.block_cols == (k + 63) / w.block_cols) {
        __m512i pair[2];
        e4m3_bf16_64(row.codes + k, _mm512_set1_ps(row.float_scales[k / w.block_cols]), e4m3, pair);
        _mm512_storeu_si512(row_out + k, pair[0]);
        _mm512_storeu_si512(row_out + k + 32, pair[1]);
        k += 64;
        continue;
      } else {
        __m512 floats[2];
        quantized_steps::decode_step<F>(tables, row, quantized_steps::step_at(w, k), floats);
        values = (__m512i)_mm512_cvtne2ps_pbh(floats[1], floats[0]);
      }
      _mm512_mask_storeu_epi16(row_out + k, n == 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1u), values);
      k += 32;
    }
  }
}

void avx512_bf16_decode_rows(const core::QuantizedMatrix& w, int64_t expert, int64_t o, int64_t count,
                             uint16_t* out, int64_t ld) {
  switch (w.format) {
    case core::QuantFormat::kMxfp4: return decode_rows_bf16_of<core::QuantFormat::kMxfp4>(w, expert, o, count, out, ld);
    case core::QuantFormat::kNvfp4: return decode_rows_bf16_of<core::QuantFormat::kNvfp4>(w, expert, o, count, out, ld);
    case core::QuantFormat::kFp8Block:
      return decode_rows_bf16_of<core::QuantFormat::kFp8Block>(w, expert, o, count, out, ld);
  }
}

}  // namespace

const QuantizedStripKernels* avx512_strip_kernels() {
  static const QuantizedStripKernels kernels{&avx512_decode_strip, &avx512_multiply_strip, "avx512"};
  return avx512::cpu_has_avx512() ? &kernels : nullptr;
}

QuantizedRowsToBf16 avx512_bf16_rows_decoder() {
  static const bool supported = avx512::cpu_has_avx512() && __builtin_cpu_supports("avx512bf16") &&
                                __builtin_cpu_supports("avx512vbmi");
  return supported ? &avx512_bf16_decode_rows : nullptr;
}

}  // namespace gemm
}  // namespace tutel

#else

namespace tutel {
namespace gemm {

const QuantizedStripKernels* avx512_strip_kernels() { return nullptr; }

QuantizedRowsToBf16 avx512_bf16_rows_decoder() { return nullptr; }

}  // namespace gemm
}  // namespace tutel

#endif
