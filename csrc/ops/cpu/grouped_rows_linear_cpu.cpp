// grouped_rows_linear and its backward on CPU: the group ends are read (free on the host) and
// checked, and the experts' rows go through the CPU grouped products (grouped_linear_cpu.cpp);
// the rows past the last end get zeros.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <vector>

#include "../grouped_rows_args.h"
#include "grouped_linear_cpu.h"
#include "grouped_offsets.h"

namespace tutel {
namespace ops {
namespace {

// Rows per expert, after checking the ends (ValueError for bad ones).
std::vector<int64_t> group_rows_of(const GroupedRowsArgs& a, const char* op) {
  const int* ends = a.offsets.data_ptr<int>();
  check_offsets_values(ends, a.experts, a.rows_count, op);
  std::vector<int64_t> counts(static_cast<size_t>(a.experts));
  for (int64_t e = 0; e < a.experts; ++e) counts[e] = ends[e] - (e > 0 ? ends[e - 1] : 0);
  return counts;
}

at::Tensor grouped_rows_linear_cpu(const at::Tensor& rows, const at::Tensor& weight,
                                   const c10::optional<at::Tensor>& bias, const at::Tensor& offsets, bool transposed) {
  const char* op = "grouped_rows_linear";
  const GroupedRowsArgs a = checked_grouped_rows(op, rows, weight, bias, offsets, transposed);
  const std::vector<int64_t> counts = group_rows_of(a, op);
  const int64_t kept = a.offsets.data_ptr<int>()[a.experts - 1];
  const c10::optional<at::Tensor> kept_bias = a.bias.defined() ? c10::optional<at::Tensor>(a.bias) : c10::nullopt;
  // grouped_linear's weight_transposed means [E, O, K]: the F.linear layout, `transposed` == false.
  if (kept == a.rows_count) return grouped_linear_cpu(a.rows, a.weight, kept_bias, counts, !transposed);
  at::Tensor out = at::empty({a.rows_count, a.outputs}, a.rows.options());
  out.narrow(0, 0, kept).copy_(grouped_linear_cpu(a.rows.narrow(0, 0, kept), a.weight, kept_bias, counts, !transposed));
  out.narrow(0, kept, a.rows_count - kept).zero_();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grouped_rows_linear_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& offsets,
    bool transposed, std::array<bool, 3> output_mask) {
  const char* op = "grouped_rows_linear_backward";
  const GroupedRowsArgs a = checked_grouped_rows(op, rows, weight, c10::nullopt, offsets, transposed);
  const at::Tensor grad = checked_grouped_rows_grad(op, grad_in, a);
  const std::vector<int64_t> counts = group_rows_of(a, op);
  const int64_t kept = a.offsets.data_ptr<int>()[a.experts - 1];
  auto [grad_rows, grad_weight, grad_bias] = grouped_linear_backward_cpu(
      grad.narrow(0, 0, kept), a.rows.narrow(0, 0, kept), a.weight, counts, !transposed, output_mask);
  if (output_mask[0] && kept < a.rows_count)  // zeros for the rows past the last end
    grad_rows = at::cat({grad_rows, at::zeros({a.rows_count - kept, a.depth}, grad_rows.options())});
  return {grad_rows, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("grouped_rows_linear", &grouped_rows_linear_cpu);
  m.impl("grouped_rows_linear_backward", &grouped_rows_linear_backward_cpu);
}

}  // namespace ops
}  // namespace tutel
