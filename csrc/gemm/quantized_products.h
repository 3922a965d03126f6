// Products of token rows grouped by expert with a stack of quantized expert matrices (MXFP4, NVFP4,
// block-scaled FP8: core/quantized_decode.h's QuantizedMatrix), for many rows per expert:
//
//     y[r] = x[r] @ W[e]^T + bias[e]    for the rows r of expert e,
//
// W[e] decoded as its format defines it.  No matrix is ever decoded whole: each work item (an
// expert and a strip of its outputs) decodes its strip of W into a small buffer of its thread, laid
// out as the multiplying kernel reads it, and multiplies every row of the expert with it while it
// is in cache.  Three ways:
//
// * tile products (bfloat16 rows, where the CPU has AMX): the strip is decoded to bfloat16 straight
//   into B tiles (tile_gemm.h's packed [O, K] layout, amx_tiles.h), each decoded value rounded to
//   bfloat16 once (nvfp4's scale and global scale applied first, in float32), and the token rows
//   packed as A tiles go through the same tile loop as tile_products;
// * bfloat16 strips (bfloat16 rows, where the CPU has AVX512-BF16 but not AMX): the strip's rows of W
//   are decoded as the float products decode them and rounded to bfloat16 (QuantizedRowsToBf16), and
//   the operator multiplies the rows with them in PyTorch's bfloat16 GEMM
//   (ops/cpu/quantized_grouped_linear_cpu.cpp);
// * float products (float32 and float16 rows, and bfloat16 rows on other CPUs; the operator widens
//   16-bit rows first): the strip is decoded exactly in float32, as [K, 32 outputs], and a blocked
//   FMA loop multiplies (AVX-512, or portable loops).
//
// Sums run in float32 throughout, each output summed by one thread (in a fixed order, whatever the
// thread count, in the tile and float products).  Rows outside every expert's range are not written.
#pragma once

#include <cstdint>
#include <vector>

#include "../core/quantized_decode.h"
#include "skinny_gemm.h"

namespace tutel {
namespace gemm {

template <class T>
struct QuantizedGroupedProducts {
  const T* x = nullptr;  // [rows, inner], row stride x_stride, elements contiguous
  int64_t x_stride = 0;
  const int64_t* offsets = nullptr;  // [experts + 1]: expert e's rows are offsets[e] .. offsets[e + 1] - 1
  int64_t experts = 0;
  core::QuantizedMatrix w;       // [experts, outputs, inner]: outputs = w.rows, inner = w.cols
  const float* bias = nullptr;   // [experts, outputs], or nullptr
  T* y = nullptr;                // [rows, outputs], row stride y_stride
  int64_t y_stride = 0;
};

// A work item: outputs [o_begin, o_end) of one expert, for all of its rows.
struct QuantizedItem {
  int64_t expert, o_begin, o_end;
};

// The items of a call, in the order the threads claim them: every expert with rows cut in strips
// of `width` outputs, the experts with the most rows first (an item's time follows its rows), each
// expert's strips together.
std::vector<QuantizedItem> quantized_items(const int64_t* offsets, int64_t experts, int64_t outputs, int64_t width);

// Outputs per strip of the float products.
constexpr int64_t kQuantizedStripOutputs = 32;

// The two kernels of the float products.
struct QuantizedStripKernels {
  // Outputs [o, o + kQuantizedStripOutputs) of expert `expert` (zero past w.rows) as floats
  // strip[k * kQuantizedStripOutputs + j] = W[expert, o + j, k], for k < w.cols.
  void (*decode_strip)(const core::QuantizedMatrix& w, int64_t expert, int64_t o, float* strip);
  // y[r * y_stride + j] = sum_k x[r * x_stride + k] * strip[k][j] (+ bias[j]) for r < rows and
  // j < outputs (<= kQuantizedStripOutputs).
  void (*multiply_strip)(const float* x, int64_t x_stride, int64_t rows, int64_t inner, const float* strip,
                         const float* bias, float* y, int64_t y_stride, int64_t outputs);
  const char* name;  // "avx512" or "portable"
};

// The portable kernels, always available.
const QuantizedStripKernels& portable_strip_kernels();

// The AVX-512 kernels, or nullptr when this build or this CPU has none.
const QuantizedStripKernels* avx512_strip_kernels();

// The widest this CPU runs.
const QuantizedStripKernels& best_strip_kernels();

// The float products of the call with `kernels`, over the threads.
void quantized_float_products(const QuantizedGroupedProducts<float>& call, const QuantizedStripKernels& kernels);

// Rows [o, o + count) of expert `expert`'s matrix (o + count <= w.rows) decoded exactly as the float
// products decode them, each value then rounded once to bfloat16 (to nearest even; subnormal values
// become zero, as AVX512-BF16's conversion takes them): the bits of W[expert, o + j, k] at
// out[j * ld + k], for j < count and k < w.cols.  For bfloat16 rows that PyTorch's bfloat16 GEMM
// multiplies with them (ops/cpu).
using QuantizedRowsToBf16 = void (*)(const core::QuantizedMatrix& w, int64_t expert, int64_t o, int64_t count,
                                     uint16_t* out, int64_t ld);

// The AVX-512 decoding with AVX512-BF16's conversion and VBMI's byte permutes, or nullptr when this
// build or this CPU lacks them.
QuantizedRowsToBf16 avx512_bf16_rows_decoder();

// Whether this build and CPU run the tile products (tile_products_available()).
bool quantized_tile_products_available();

// The tile products of the call, over the threads.  Only where quantized_tile_products_available().
void quantized_tile_products(const QuantizedGroupedProducts<bfloat16>& call);

}  // namespace gemm
}  // namespace tutel
