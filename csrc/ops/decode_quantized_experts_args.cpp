#include "decode_quantized_experts_args.h"

#include <cmath>
#include <limits>

#include "checks.h"
#include "quantized_stack_args.h"

namespace tutel {
namespace ops {
namespace {

constexpr const char* kOp = "decode_quantized_experts";

core::ExpertActivation activation_of(const std::string& name) {
  if (name == "gated") return core::ExpertActivation::kGated;
  if (name == "gelu") return core::ExpertActivation::kGelu;
  if (name == "gelu_tanh") return core::ExpertActivation::kGeluTanh;
  TORCH_CHECK_VALUE(name == "relu", "tutel::", kOp, ": `activation` '", name,
                    "' is not a unit; allowed: 'gated', 'gelu', 'gelu_tanh', 'relu'");
  return core::ExpertActivation::kRelu;
}

at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t experts, int64_t width, const at::Tensor& x,
                        const char* name) {
  if (!bias.has_value()) return at::Tensor();
  check_dtype(*bias, at::kFloat, kOp, name);
  TORCH_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == experts && bias->size(1) == width, "tutel::", kOp, ": `",
                    name, "` must be [", experts, ", ", width, "], got ", bias->sizes());
  check_same_device(x, *bias, kOp, name);
  return bias->contiguous();
}

}  // namespace

DecodeQuantizedExpertsArgs decode_quantized_experts_args(
    const at::Tensor& x, const at::Tensor& expert_ids, const c10::optional<at::Tensor>& weights,
    const std::string& format, const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
    const c10::optional<at::Tensor>& gate_up_global, const at::Tensor& down, const at::Tensor& down_scales,
    const c10::optional<at::Tensor>& down_global, at::IntArrayRef block, const c10::optional<at::Tensor>& gate_up_bias,
    const c10::optional<at::Tensor>& down_bias, const std::string& activation, double alpha, double up_offset,
    c10::optional<double> limit, bool interleaved, bool routing_as_given) {
  DecodeQuantizedExpertsArgs a;
  a.format = quant_format_of(format, kOp);
  a.unit.activation = activation_of(activation);
  check_dim(x, 2, kOp, "x");
  const auto dtype = x.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "tutel::", kOp,
                   ": `x` must be float32, bfloat16 or float16, got ", dtype);
  a.x = x.size(1) <= 1 || x.stride(1) == 1 ? x : x.contiguous();
  check_routed_choices(x, expert_ids, weights, kOp);
  if (routing_as_given) {
    a.expert_ids = expert_ids;
    if (weights.has_value()) a.weights = *weights;
  } else {
    a.expert_ids = expert_ids.to(at::kLong).contiguous();
    if (weights.has_value()) a.weights = weights->to(at::kFloat).contiguous();
  }
  read_quant_block(a.format, block, kOp, a.block_rows, a.block_cols);
  a.gate_up = checked_quantized_stack(a.format, gate_up, gate_up_scales, gate_up_global, a.block_rows, a.block_cols,
                                      x, kOp, {"gate_up", "gate_up_scales", "gate_up_global"});
  a.down = checked_quantized_stack(a.format, down, down_scales, down_global, a.block_rows, a.block_cols, x, kOp,
                                   {"down", "down_scales", "down_global"});
  a.tokens = x.size(0);
  a.k = expert_ids.size(1);
  a.hidden = x.size(1);
  a.experts = gate_up.size(0);
  a.inter = a.down.cols;
  a.outputs = a.down.rows;
  TORCH_CHECK_VALUE(a.experts >= 1 && down.size(0) == a.experts, "tutel::", kOp, ": `gate_up` holds ", a.experts,
                    " experts and `down` ", down.size(0), "; both must hold the same number, at least 1");
  TORCH_CHECK_VALUE(a.gate_up.cols == a.hidden, "tutel::", kOp, ": `gate_up` ", gate_up.sizes(), " holds rows of ",
                    a.gate_up.cols, " elements but `x` has ", a.hidden, " features");
  TORCH_CHECK_VALUE(a.hidden >= 1 && a.inter >= 1, "tutel::", kOp, ": `x` has ", a.hidden,
                    " features and `down` rows of ", a.inter, " elements; both must be at least 1");
  const bool gated = a.unit.activation == core::ExpertActivation::kGated;
  const int64_t up_rows = gated ? 2 * a.inter : a.inter;
  TORCH_CHECK_VALUE(a.gate_up.rows == up_rows, "tutel::", kOp, ": `gate_up` ", gate_up.sizes(), " must hold ",
                    up_rows, " rows (", gated ? "gate and up rows, twice" : "up rows, as many as",
                    " the ", a.inter, " elements of a `down` row), got ", a.gate_up.rows);
  a.gate_up_bias = checked_bias(gate_up_bias, a.experts, up_rows, x, "gate_up_bias");
  a.down_bias = checked_bias(down_bias, a.experts, a.outputs, x, "down_bias");
  TORCH_CHECK_VALUE(std::isfinite(alpha) && std::isfinite(up_offset), "tutel::", kOp,
                    ": alpha and up_offset must be finite, got alpha=", alpha, " and up_offset=", up_offset);
  TORCH_CHECK_VALUE(!limit.has_value() || (std::isfinite(*limit) && *limit > 0), "tutel::", kOp,
                    ": limit must be None or a finite number > 0, got ", limit.value_or(0.0));
  TORCH_CHECK_VALUE(gated || !interleaved, "tutel::", kOp, ": the ", activation,
                    " unit has up rows only; `interleaved` must be false");
  a.unit.gated = core::GatedUnit{alpha, up_offset, limit.has_value(), limit.value_or(0.0), interleaved};
  return a;
}

}  // namespace ops
}  // namespace tutel
