// W8A8's dynamic activation quantization (DeepSeek-V3's act_quant, the rule transformers'
// finegrained-fp8 experts apply): each row of [rows, cols] activations, per group of `group`
// columns (the last group may be partial), is quantized to E4M3 with the float32 scale
// amax / 448 (the group's largest magnitude) as codes = E4M3 rounding of value / max(scale, 1e-12),
// and returned dequantized: codes * scale in float32, the values the product then multiplies.  An
// all-zero group gives zeros; NaN in a group makes the whole group NaN.  The same arithmetic as
// tutel.ops.quantized_experts.dynamic_activations (PyTorch's operators), bit for bit, and as
// kernels/quantized_grouped_linear.cu's in-kernel quantization.
#pragma once

#include <cstdint>

#include "scalar.h"

namespace tutel {
namespace core {

// The E4M3 (fn) value nearest to x, ties to the even code (PyTorch's .to(torch.float8_e4m3fn)),
// saturating: magnitudes past 464 and infinities give 448 (PyTorch's conversion gives NaN from 480
// on, which the quantization never meets: |value / scale| <= 448 up to rounding); NaN stays NaN.
float e4m3_rounded(float x);

// out[r, c] for rows r of x [rows, cols] (row stride x_stride; out contiguous [rows, cols]), in
// parallel over the rows.  T: float, bfloat16 or float16 (widened exactly to float32 first).
template <class T>
void dynamic_activations(const T* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t group, float* out);

}  // namespace core
}  // namespace tutel
