#include "quantized_grouped_linear_args.h"

#include "checks.h"

namespace tutel {
namespace ops {
namespace {

constexpr const char* kOp = "quantized_grouped_linear";

// The ends' dtype (int32 / int64), shape [E] and device, without reading them.
void check_ends_shape(const at::Tensor& ends, int64_t experts, const at::Tensor& rows) {
  check_dim(ends, 1, kOp, "ends");
  TORCH_CHECK_TYPE(ends.scalar_type() == at::kInt || ends.scalar_type() == at::kLong, "tutel::", kOp,
                   ": `ends` must be int32 or int64, got ", ends.scalar_type());
  check_same_device(rows, ends, kOp, "ends");
  TORCH_CHECK_VALUE(ends.size(0) == experts, "tutel::", kOp, ": `ends` must hold one end per expert, [", experts,
                    "], got ", ends.sizes());
}

// The ends [E] as offsets 0, end_0, .., end_{E-1}: non-decreasing, within [0, n].
std::vector<int64_t> checked_offsets_of(const at::Tensor& ends, int64_t experts, int64_t n) {
  const at::Tensor values = ends.to(at::kLong).contiguous();
  const int64_t* end = values.data_ptr<int64_t>();
  std::vector<int64_t> offsets(size_t(experts) + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK_VALUE(end[e] >= offsets[size_t(e)] && end[e] <= n, "tutel::", kOp, ": `ends` must be non-decreasing "
                      "within [0, ", n, "] (the rows of `rows`), got ends[", e, "] = ", end[e],
                      e > 0 ? " after " : "", e > 0 ? std::to_string(offsets[size_t(e)]) : std::string());
    offsets[size_t(e) + 1] = end[e];
  }
  return offsets;
}

// W8A8's group width: 0, or for fp8_block a multiple of 16 or at least K.
void check_activation_group(int64_t group, core::QuantFormat format, int64_t depth) {
  TORCH_CHECK_VALUE(group >= 0, "tutel::", kOp, ": `activation_group` must be 0 (weight-only) or a positive group "
                    "width, got ", group);
  if (group == 0) return;
  TORCH_CHECK_VALUE(format == core::QuantFormat::kFp8Block, "tutel::", kOp, ": `activation_group` = ", group,
                    " (W8A8 activations) needs format 'fp8_block', got '", quant_format_name(format), "'");
  TORCH_CHECK_VALUE(group % 16 == 0 || group >= depth, "tutel::", kOp, ": `activation_group` must be a multiple of "
                    "16 or at least K = ", depth, " (one group a row), got ", group);
}

}  // namespace

QuantizedGroupedLinearArgs quantized_grouped_linear_args(const at::Tensor& rows, const at::Tensor& ends,
                                                         const std::string& format, const at::Tensor& codes,
                                                         const at::Tensor& scales,
                                                         const c10::optional<at::Tensor>& global_scale,
                                                         at::IntArrayRef block, const c10::optional<at::Tensor>& bias,
                                                         int64_t activation_group, bool read_ends) {
  QuantizedGroupedLinearArgs a;
  a.format = quant_format_of(format, kOp);
  check_dim(rows, 2, kOp, "rows");
  const auto dtype = rows.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "tutel::", kOp,
                   ": `rows` must be float32, bfloat16 or float16, got ", dtype);
  a.rows = rows.size(1) <= 1 || rows.stride(1) == 1 ? rows : rows.contiguous();
  read_quant_block(a.format, block, kOp, a.block_rows, a.block_cols);
  a.stack = checked_quantized_stack(a.format, codes, scales, global_scale, a.block_rows, a.block_cols, rows, kOp,
                                    {"codes", "scales", "global_scale"});
  a.experts = codes.size(0);
  TORCH_CHECK_VALUE(a.experts >= 1, "tutel::", kOp, ": `codes` ", codes.sizes(), " must hold at least one expert");
  TORCH_CHECK_VALUE(a.stack.cols == rows.size(1) && a.stack.cols >= 1, "tutel::", kOp, ": `codes` ", codes.sizes(),
                    " holds rows of ", a.stack.cols, " elements but `rows` has ", rows.size(1),
                    " features; they must agree and be at least 1");
  check_activation_group(activation_group, a.format, a.stack.cols);
  a.activation_group = activation_group;
  check_ends_shape(ends, a.experts, rows);
  if (read_ends) a.offsets = checked_offsets_of(ends, a.experts, rows.size(0));
  if (bias.has_value()) {
    check_floating(*bias, kOp, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == a.experts && bias->size(1) == a.stack.rows, "tutel::", kOp,
                      ": `bias` must be [", a.experts, ", ", a.stack.rows, "], got ", bias->sizes());
    check_same_device(rows, *bias, kOp, "bias");
    a.bias = bias->to(at::kFloat).contiguous();
  }
  return a;
}

}  // namespace ops
}  // namespace tutel
