// CUDA implementation of grouped_rows_linear and its backward (kernels/grouped_rows_gemm.cu): the
// group ends stay on the device, read by the kernels, so no call synchronises with the host.  The
// product is one launch (the bias and the zero rows past the last end included); the backward one
// for the row gradient and one for the weight and bias gradients.  The kernels take `offsets` as
// their running maximum clamped to [0, N] (nothing is checked: that would read them back).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <tuple>

#include "../../cuda/expert_launch_plan.h"
#include "../grouped_rows_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::grouped_rows_product> kProduct;
const Kernel<cuda::kernels::grouped_rows_weight_grad> kWeightGrad;

// How grouped_rows_product reads B_e (TUTEL_REDUCTION_CONTIGUOUS / TUTEL_COLUMNS_CONTIGUOUS there).
constexpr int kReductionContiguous = 0;  // B_e[r][c] at b[e][c][r]
constexpr int kColumnsContiguous = 1;    // B_e[r][c] at b[e][r][c]

// The weight gradient's grid has one row of blocks per expert: CUDA's limit on grid.y.
constexpr int64_t kMaxExperts = 65535;

const int* ends_ptr(const GroupedRowsArgs& a) { return static_cast<const int*>(input_ptr(a.offsets)); }

at::Tensor grouped_rows_linear_cuda(const at::Tensor& rows, const at::Tensor& weight,
                                    const c10::optional<at::Tensor>& bias, const at::Tensor& offsets,
                                    bool transposed) {
  const char* op = "grouped_rows_linear";
  const GroupedRowsArgs a = checked_grouped_rows(op, rows, weight, bias, offsets, transposed);
  at::Tensor out = at::empty({a.rows_count, a.outputs}, a.rows.options());
  if (out.numel() == 0) return out;
  CudaOpScope scope(a.rows);
  // out[i] = rows[i] @ B_e: B_e[k][o] = W[e, o, k] (F.linear layout) or W[e, k, o].
  cuda::launch_kernel(kProduct.get(scope.device(), data_variant(a.rows.scalar_type())),
                      cuda::plan_grouped_rows_product(a.rows_count, a.experts, a.outputs), scope.stream(), op,
                      input_ptr(a.rows), int64_t(a.rows.stride(0)), input_ptr(a.weight),
                      transposed ? kColumnsContiguous : kReductionContiguous, input_ptr(a.bias), ends_ptr(a),
                      a.rows_count, a.experts, a.depth, a.outputs, output_ptr(out));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grouped_rows_linear_backward_cuda(
    const at::Tensor& grad_in, const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& offsets,
    bool transposed, std::array<bool, 3> output_mask) {
  const char* op = "grouped_rows_linear_backward";
  const GroupedRowsArgs a = checked_grouped_rows(op, rows, weight, c10::nullopt, offsets, transposed);
  const at::Tensor grad = checked_grouped_rows_grad(op, grad_in, a);
  TORCH_CHECK_VALUE(a.experts <= kMaxExperts, "tutel::", op, ": at most ", kMaxExperts,
                    " experts on CUDA, got ", a.experts);
  const auto options = a.rows.options();
  // Those not asked for are empty, shaped as grouped_linear_backward's (the CPU operator's).
  at::Tensor grad_rows = at::empty({output_mask[0] ? a.rows_count : 0, a.depth}, options);
  at::Tensor grad_weight = output_mask[1] ? at::empty(a.weight.sizes(), options) : at::empty({0}, options);
  at::Tensor grad_bias = at::empty({output_mask[2] ? a.experts : 0, a.outputs}, options);
  if (!output_mask[0] && !output_mask[1] && !output_mask[2]) return {grad_rows, grad_weight, grad_bias};
  CudaOpScope scope(a.rows);
  const Variant variant = data_variant(a.rows.scalar_type());
  if (grad_rows.numel() > 0) {
    // d rows[i] = grad[i] @ B'_e with B'_e[o][k] = W[e, o, k]: the weight read the other way round.
    cuda::launch_kernel(kProduct.get(scope.device(), variant),
                        cuda::plan_grouped_rows_product(a.rows_count, a.experts, a.depth), scope.stream(), op,
                        input_ptr(grad), int64_t(a.outputs), input_ptr(a.weight),
                        transposed ? kReductionContiguous : kColumnsContiguous, static_cast<const void*>(nullptr),
                        ends_ptr(a), a.rows_count, a.experts, a.outputs, a.depth, output_ptr(grad_rows));
  }
  // d W[e] = grad_e^T rows_e ([O, K]) or rows_e^T grad_e ([K, O]); d bias: the column sums of grad.
  const int bias_of = output_mask[2] ? (transposed ? 2 : 1) : 0;
  const at::Tensor& p = transposed ? a.rows : grad;
  const at::Tensor& q = transposed ? grad : a.rows;
  const int64_t p_cols = transposed ? a.depth : a.outputs, q_cols = transposed ? a.outputs : a.depth;
  const cuda::WeightGradPlan plan =
      cuda::plan_grouped_rows_weight_grad(a.experts, p_cols, q_cols, output_mask[1], bias_of);
  cuda::launch_kernel(kWeightGrad.get(scope.device(), variant), plan.grid, scope.stream(), op, input_ptr(p),
                      int64_t(p.stride(0)), input_ptr(q), int64_t(q.stride(0)), ends_ptr(a), a.rows_count, p_cols,
                      q_cols, plan.col_tiles, int(output_mask[1]), bias_of, output_ptr(grad_weight),
                      output_ptr(grad_bias));
  return {grad_rows, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) {
  m.impl("grouped_rows_linear", &grouped_rows_linear_cuda);
  m.impl("grouped_rows_linear_backward", &grouped_rows_linear_backward_cuda);
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
