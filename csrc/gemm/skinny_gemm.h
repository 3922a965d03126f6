// Products of a few rows with a large matrix that read the matrix once: the expert GEMMs of
// decoding and of small batches, where each expert multiplies a handful of token rows.
//
// A general GEMM library packs the matrix into panels before multiplying, which pays off when
// many rows reuse each panel; with 1 to ~32 rows the packing costs as much as the product and
// the matrix is read more than once (measured in benchmarks/grouped_gemm.py).  These kernels
// stream the matrix straight from memory in register blocks and keep the rows in cache, so a
// product costs about the time to read the matrix: the bandwidth limit of decoding.
//
// For r < rows and o in [o_begin, o_end):
//
//     y[r, o] = sum_k x[r, k] * W(o, k)  (+ bias[o])
//
// with W(o, k) = w[o * w_stride + k] (kOutputsByInner: W's rows are the outputs, F.linear's
// [O, K] layout) or W(o, k) = w[k * w_stride + o] (kInnerByOutputs: [K, O], x @ W).  Sums run in
// float for float / bfloat16 / float16 and in double for double, rounded to T once at the end;
// the summation order differs from a GEMM library's, so results agree with one to the
// accumulation type's rounding, not bitwise.
#pragma once

#include <cstdint>
#include <vector>

#include "../core/scalar.h"

namespace tutel {
namespace gemm {

// The storage types and their rounding are the core's (scalar.h), shared with the MoE kernels.
using core::acc_t;
using core::bfloat16;
using core::float16;
using core::Scalar;

enum class WeightLayout {
  kOutputsByInner,  // [O, K]: y = x @ W^T
  kInnerByOutputs,  // [K, O]: y = x @ W
};

template <class T>
struct SkinnyProduct {
  const T* x;  // rows x inner, row stride x_stride
  int64_t x_stride;
  const T* w;  // the matrix, layout and w_stride as above
  int64_t w_stride;
  const T* bias;  // [outputs] or nullptr
  T* y;           // rows x outputs, row stride y_stride
  int64_t y_stride;
  int64_t rows;
};

// Computes outputs [o_begin, o_end) of one product whose sums run over `inner` elements.
template <class T>
using SkinnyKernel = void (*)(const SkinnyProduct<T>& p, int64_t inner, int64_t o_begin, int64_t o_end);

template <class T>
struct SkinnyKernels {
  SkinnyKernel<T> outputs_by_inner;
  SkinnyKernel<T> inner_by_outputs;
  // The width in bits of the vectors each computes with: 512 (AVX-512), 256 (AVX2) or 0
  // (portable).  Where PyTorch's GEMM overtakes the skinny products depends on it.
  int outputs_by_inner_bits;
  int inner_by_outputs_bits;
};

// The fastest kernels this CPU supports (chosen on first use): AVX-512, else AVX2, else portable.
template <class T>
const SkinnyKernels<T>& skinny_kernels();

// The portable kernels, always available (the tests' second implementation).
template <class T>
const SkinnyKernels<T>& portable_skinny_kernels();

// The AVX2 + FMA kernels, or nullptr when this build or this CPU has none (and for double).
template <class T>
const SkinnyKernels<T>* avx2_skinny_kernels();

// The AVX-512 kernels (AVX512F/BW/VL/DQ; bfloat16 [O, K] on AVX512-BF16's dot products where the
// CPU has them), or nullptr when this build or this CPU has none (and for double).
template <class T>
const SkinnyKernels<T>* avx512_skinny_kernels();

// The same with 16-bit values widened to float in registers: what avx512_skinny_kernels gives for
// bfloat16 on a CPU without AVX512-BF16 (and for float and float16 everywhere); nullptr as above.
// The tests run them on every CPU with AVX-512.
template <class T>
const SkinnyKernels<T>* avx512_widening_skinny_kernels();

// Runs every product (all with `inner`, `outputs` and `layout` in common), splitting their
// outputs into tiles that run in parallel: one fork for all of them, so many small experts
// keep every thread busy.
template <class T>
void skinny_products(const std::vector<SkinnyProduct<T>>& products, int64_t inner, int64_t outputs,
                     WeightLayout layout);

}  // namespace gemm
}  // namespace tutel
