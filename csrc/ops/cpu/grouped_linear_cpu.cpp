// CPU implementation of grouped_linear and its backward: one linear map per
// group of consecutive rows, every group's GEMM issued from one call (no
// Python loop, no padding to the largest group).  Each GEMM writes straight into
// its rows of the output, so nothing is gathered or copied.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../checks.h"

namespace tutel {
namespace ops {
namespace {

// weight[g] as the [K, O] matrix the rows are multiplied by.
at::Tensor right_factor(const at::Tensor& weight, int64_t group, bool weight_transposed) {
  at::Tensor w = weight.select(0, group);
  return weight_transposed ? w.t() : w;
}

// Row offsets of the groups; checks the counts against the rows of x.
std::vector<int64_t> group_offsets(at::IntArrayRef group_rows, int64_t groups, int64_t rows, const char* op) {
  TORCH_CHECK_VALUE(int64_t(group_rows.size()) == groups, "tutel::", op, ": `group_rows` has ",
                    group_rows.size(), " entries but `weight` holds ", groups, " groups");
  std::vector<int64_t> offsets(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK_VALUE(group_rows[g] >= 0, "tutel::", op, ": group_rows[", g, "] = ", group_rows[g],
                      " is negative; row counts must be >= 0");
    offsets[g + 1] = offsets[g] + group_rows[g];
  }
  TORCH_CHECK_VALUE(offsets[groups] == rows, "tutel::", op, ": `group_rows` sums to ", offsets[groups],
                    " but `x` has ", rows, " rows");
  return offsets;
}

void check_operands(const at::Tensor& x, const at::Tensor& weight, bool weight_transposed, const char* op) {
  check_dim(x, 2, op, "x");
  check_dim(weight, 3, op, "weight");
  check_floating(x, op, "x");
  check_dtype(weight, x.scalar_type(), op, "weight");
  check_same_device(x, weight, op, "weight");
  const int64_t inner = weight_transposed ? weight.size(2) : weight.size(1);
  TORCH_CHECK_VALUE(inner == x.size(1), "tutel::", op, ": `x` has ", x.size(1), " features but `weight` ",
                    weight.sizes(), (weight_transposed ? " (transposed)" : ""), " expects ", inner);
}

at::Tensor grouped_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              at::IntArrayRef group_rows, bool weight_transposed) {
  const char* op = "grouped_linear";
  check_operands(x_in, weight, weight_transposed, op);
  const at::Tensor x = x_in.contiguous();
  const int64_t groups = weight.size(0);
  const int64_t outputs = weight_transposed ? weight.size(1) : weight.size(2);
  if (bias.has_value()) {
    check_dtype(*bias, x.scalar_type(), op, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == groups && bias->size(1) == outputs, "tutel::", op,
                      ": `bias` must have shape [", groups, ", ", outputs, "], got ", bias->sizes());
  }
  const std::vector<int64_t> offsets = group_offsets(group_rows, groups, x.size(0), op);
  at::Tensor out = at::empty({x.size(0), outputs}, x.options());
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = offsets[g + 1] - offsets[g];
    if (count == 0) continue;
    at::Tensor rows_out = out.narrow(0, offsets[g], count);
    const at::Tensor rows_in = x.narrow(0, offsets[g], count);
    if (bias.has_value()) {
      at::addmm_out(rows_out, bias->select(0, g), rows_in, right_factor(weight, g, weight_transposed));
    } else {
      at::mm_out(rows_out, rows_in, right_factor(weight, g, weight_transposed));
    }
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grouped_linear_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& weight, at::IntArrayRef group_rows,
    bool weight_transposed, std::array<bool, 3> output_mask) {
  const char* op = "grouped_linear_backward";
  check_operands(x_in, weight, weight_transposed, op);
  const at::Tensor x = x_in.contiguous(), grad = grad_in.contiguous();
  const int64_t groups = weight.size(0);
  const int64_t outputs = weight_transposed ? weight.size(1) : weight.size(2);
  check_dtype(grad, x.scalar_type(), op, "grad");
  TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == x.size(0) && grad.size(1) == outputs, "tutel::", op,
                    ": `grad` must have shape [", x.size(0), ", ", outputs, "], got ", grad.sizes());
  const std::vector<int64_t> offsets = group_offsets(group_rows, groups, x.size(0), op);

  // Gradients not asked for come back as empty tensors.
  at::Tensor grad_x = at::empty({output_mask[0] ? x.size(0) : 0, x.size(1)}, x.options());
  at::Tensor grad_weight = output_mask[1] ? at::empty(weight.sizes(), weight.options()) : at::empty({0}, x.options());
  at::Tensor grad_bias = at::empty({output_mask[2] ? groups : 0, outputs}, x.options());
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = offsets[g + 1] - offsets[g];
    const at::Tensor rows_grad = grad.narrow(0, offsets[g], count);
    const at::Tensor rows_in = x.narrow(0, offsets[g], count);
    if (count > 0 && output_mask[0]) {
      // d x = d y @ W^T, with W = weight[g] or weight[g]^T.
      at::Tensor w = weight.select(0, g);
      at::Tensor rows_grad_x = grad_x.narrow(0, offsets[g], count);
      at::mm_out(rows_grad_x, rows_grad, weight_transposed ? w : w.t());
    }
    if (output_mask[1]) {
      // d W has weight[g]'s layout: [K, O] = x^T dy, or [O, K] = dy^T x.  A group
      // without rows contributes nothing (a zero gradient).
      at::Tensor dw = grad_weight.select(0, g);
      if (count == 0) {
        dw.zero_();
      } else if (weight_transposed) {
        at::mm_out(dw, rows_grad.t(), rows_in);
      } else {
        at::mm_out(dw, rows_in.t(), rows_grad);
      }
    }
    if (output_mask[2]) {
      at::Tensor db = grad_bias.select(0, g);
      if (count == 0) {
        db.zero_();
      } else {
        at::sum_out(db, rows_grad, {0});
      }
    }
  }
  return {grad_x, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("grouped_linear", &grouped_linear_cpu);
  m.impl("grouped_linear_backward", &grouped_linear_backward_cpu);
}

}  // namespace ops
}  // namespace tutel
