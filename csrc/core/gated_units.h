// Gated linear units of the experts' up projection, forward and backward, each in one pass over
// the rows.
//
// Row r of the up projection holds 2I values; with `interleaved` the gate and up values
// alternate (g0, u0, g1, u1, ...: gpt-oss), otherwise the first I are the gates and the last I
// the ups (LLaMA, Mixtral, Qwen, DeepSeek), or gates and ups are two tensors (Tutel's
// llama_ffn, whose W_fc1 and W_fc2 are separate products).  With g' = min(g, limit), u' = clamp(u, -limit,
// limit) when the unit is `clamped` (g' = g, u' = u otherwise) and s = sigmoid(alpha * g'):
//
//     h    = (u' + up_offset) * g' * s
//     d g  = d h * (u' + up_offset) * s * (1 + alpha * g' * (1 - s))  where g <= limit, else 0
//     d u  = d h * g' * s                                              where |u| <= limit, else 0
//
// With a per-expert bias (gpt-oss' experts), rows grouped by expert: g and u above are
// gate + gate bias and up + up bias of the row's expert, added in the accumulation type (float
// for 16-bit data) and not rounded to the storage type in between, before the clamp; the
// gradients are taken at these biased values (and d gate_up is also the gradient of the bias
// before the per-expert sum, which the callers do).  The CUDA kernels do the same operations
// in the same order.
//
// SwiGLU is alpha 1, up_offset 0, not clamped (h = silu(g) * u); gpt-oss is alpha 1.702,
// up_offset 1, limit 7.  The gradient passes where the value lies inside the closed bounds, as
// PyTorch's clamp lets it.  Composed from PyTorch operators this is five to twelve passes over
// [rows, I] tensors, each a fresh allocation, and the backward of the interleaved layout
// scatters both halves into zero-filled [rows, 2I] buffers; here it is one read and one write.
//
// Sums and products run in float for float / bfloat16 / float16 and in double for double,
// rounded to T once.  The vectorised exponential agrees with std::exp to a few float ulps, so
// results match PyTorch's to the storage type's rounding, not bitwise.
#pragma once

#include <cstdint>

#include "scalar.h"

namespace tutel {
namespace core {

struct GatedUnit {  // in double, so that float64 data keeps every digit; float kernels round once
  double alpha;
  double up_offset;
  bool clamped;
  double limit;  // used when clamped
  bool interleaved;
};

// The operands of a pass.  Gates and ups lie in one [rows, 2I] tensor (gate_up: `up` points
// I values into each row, or, interleaved, one value in) or in two [rows, I] tensors.
template <class T>
struct GatedRows {
  const T* gate;  // row r's gate i at gate[r * gate_stride + step * i] (step 2 when interleaved)
  int64_t gate_stride;
  const T* up;  // row r's up i at up[r * up_stride + step * i]
  int64_t up_stride;
  const T* grad;  // backward: d h, rows x I, row stride grad_stride
  int64_t grad_stride;
  T* out;  // forward: h (rows x I); backward: d gate, laid out like the gates
  int64_t out_stride;
  T* out_up;  // backward: d up, laid out like the ups
  int64_t out_up_stride;
  int64_t rows;
  int64_t width;  // I
  // The per-expert bias: expert e's gate bias i at gate_bias[e * bias_stride + step * i] and
  // its up bias at up_bias[...] likewise (a bias row laid out like a row of the gates and ups),
  // rows grouped by expert with expert_ends[e] the end of expert e's rows (non-decreasing; see
  // expert_of_grouped_row).  expert_ends null: no bias.
  const T* gate_bias = nullptr;
  const T* up_bias = nullptr;
  int64_t bias_stride = 0;
  const int32_t* expert_ends = nullptr;
  int64_t experts = 0;
};

// The expert owning grouped row `row`: the first e with ends[e] > row, or `experts` when the row
// lies past the last expert's rows.  A binary search, the CUDA kernels' expert_of_grouped_row
// step for step, so that both pick the same expert even for ends that are not sorted (which
// the operators do not check: that would need the values on the host).
inline int64_t expert_of_grouped_row(const int32_t* ends, int64_t experts, int64_t row) {
  int64_t low = 0, high = experts;
  while (low < high) {
    const int64_t mid = (low + high) >> 1;
    if (int64_t(ends[mid]) > row) high = mid; else low = mid + 1;
  }
  return low;
}

// Row `row`'s bias rows (gate and up, at unit 0), or false when the row takes no bias.
template <class T>
inline bool bias_of_row(const GatedRows<T>& p, int64_t row, const T** gate_bias, const T** up_bias) {
  if (p.expert_ends == nullptr) return false;
  const int64_t expert = expert_of_grouped_row(p.expert_ends, p.experts, row);
  if (expert >= p.experts) return false;
  *gate_bias = p.gate_bias + expert * p.bias_stride;
  *up_bias = p.up_bias + expert * p.bias_stride;
  return true;
}

// The operands when gates and ups share one [rows, 2I] tensor (and the backward's d gate_up
// has that layout too); `grad` and `d_gate_up` may be null for the forward, `h` for the backward.
template <class T>
GatedRows<T> concatenated_gate_up(bool interleaved, const T* gate_up, int64_t gate_up_stride, const T* grad,
                          int64_t grad_stride, T* h, int64_t h_stride, T* d_gate_up, int64_t d_stride, int64_t rows,
                          int64_t width) {
  const int64_t up_shift = interleaved ? 1 : width;
  T* out = d_gate_up ? d_gate_up : h;
  return GatedRows<T>{gate_up, gate_up_stride, gate_up + up_shift, gate_up_stride, grad, grad_stride,
                      out, d_gate_up ? d_stride : h_stride, d_gate_up ? d_gate_up + up_shift : nullptr, d_stride,
                      rows, width};
}

// `rows` with the per-expert bias of gate_up-layout rows: bias [experts, 2I] (row stride
// bias_stride) and the experts' row ends.
template <class T>
GatedRows<T> with_grouped_bias(GatedRows<T> rows, bool interleaved, const T* bias, int64_t bias_stride,
                               const int32_t* expert_ends, int64_t experts) {
  rows.gate_bias = bias;
  rows.up_bias = bias == nullptr ? nullptr : bias + (interleaved ? 1 : rows.width);
  rows.bias_stride = bias_stride;
  rows.expert_ends = expert_ends;
  rows.experts = experts;
  return rows;
}

// Processes rows [row_begin, row_end).
template <class T>
using GatedKernel = void (*)(const GatedUnit& unit, const GatedRows<T>& rows, int64_t row_begin, int64_t row_end);

template <class T>
struct GatedKernels {
  GatedKernel<T> forward;
  GatedKernel<T> backward;
};

// The portable kernels, always available (the tests' second implementation).
template <class T>
const GatedKernels<T>& portable_gated_kernels();

// Units [unit_begin, I) of one row, portably: the rest of a row the vector kernels leave.
template <class T>
void portable_forward_units(const GatedUnit& unit, const GatedRows<T>& rows, int64_t row, int64_t unit_begin);
template <class T>
void portable_backward_units(const GatedUnit& unit, const GatedRows<T>& rows, int64_t row, int64_t unit_begin);

// The AVX2 + FMA kernels, or nullptr when this build or this CPU has none (and for double).
template <class T>
const GatedKernels<T>* avx2_gated_kernels();

// h for every row, rows split over the threads.
template <class T>
void gated_forward(const GatedUnit& unit, const GatedRows<T>& rows);

// d gate_up for every row, rows split over the threads.
template <class T>
void gated_backward(const GatedUnit& unit, const GatedRows<T>& rows);

// h for every row on the calling thread, with the kernels gated_forward runs: for callers that
// split their own work over the threads (the quantized decode's gate/up pass).
template <class T>
void gated_forward_here(const GatedUnit& unit, const GatedRows<T>& rows);

}  // namespace core
}  // namespace tutel
