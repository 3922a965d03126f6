// The CPU grouped linear map, for other CPU operators that run it inside one call.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <tuple>

namespace tutel {
namespace ops {

// tutel::grouped_linear on CPU (schemas.cpp): rows [o_g, o_g + group_rows[g]) of x [N, K] times
// weight[g] ([K, O], or [O, K] when weight_transposed) plus bias[g]; returns [N, O].
at::Tensor grouped_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              at::IntArrayRef group_rows, bool weight_transposed);

// tutel::grouped_linear_backward on CPU: the gradients of x, weight and bias (those not in
// output_mask come back empty).
std::tuple<at::Tensor, at::Tensor, at::Tensor> grouped_linear_backward_cpu(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef group_rows,
    bool weight_transposed, std::array<bool, 3> output_mask);

}  // namespace ops
}  // namespace tutel
