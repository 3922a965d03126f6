// The CPU grouped linear map, for other CPU operators that run it inside one call.
#pragma once

#include <ATen/ATen.h>

namespace tutel {
namespace ops {

// tutel::grouped_linear on CPU (schemas.cpp): rows [o_g, o_g + group_rows[g]) of x [N, K] times
// weight[g] ([K, O], or [O, K] when weight_transposed) plus bias[g]; returns [N, O].
at::Tensor grouped_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              at::IntArrayRef group_rows, bool weight_transposed);

}  // namespace ops
}  // namespace tutel
