#include "gated_unit_args.h"

#include <cmath>

#include "checks.h"
#include "core_types.h"

namespace tutel {
namespace ops {

core::GatedUnit gated_unit_params(double alpha, double up_offset, const c10::optional<double>& limit,
                                  bool interleaved, const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(alpha) && std::isfinite(up_offset), "tutel::", op,
                    ": `alpha` and `up_offset` must be finite, got ", alpha, " and ", up_offset);
  TORCH_CHECK_VALUE(!limit.has_value() || (std::isfinite(*limit) && *limit > 0), "tutel::", op,
                    ": `limit` must be None or a finite number > 0, got ", limit.value_or(0));
  return core::GatedUnit{alpha, up_offset, limit.has_value(), limit.value_or(0), interleaved};
}

at::Tensor checked_gate_up(const at::Tensor& gate_up, const char* op) {
  check_dim(gate_up, 2, op, "gate_up");
  check_floating(gate_up, op, "gate_up");
  TORCH_CHECK_VALUE(gate_up.size(1) % 2 == 0, "tutel::", op, ": `gate_up` must have an even number of columns ",
                    "(gate and up values), got ", gate_up.size(1));
  return rows_with_unit_stride(gate_up);
}

std::pair<at::Tensor, at::Tensor> checked_grouped_bias(const c10::optional<at::Tensor>& bias_in,
                                                       const c10::optional<at::Tensor>& offsets_in,
                                                       const at::Tensor& gate_up, const char* op) {
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  const bool has_offsets = offsets_in.has_value() && offsets_in->defined();
  TORCH_CHECK_VALUE(has_bias == has_offsets, "tutel::", op, ": `bias` and `offsets` must be given together, got ",
                    has_bias ? "`bias` without `offsets`" : "`offsets` without `bias`");
  if (!has_bias) return {at::Tensor(), at::Tensor()};
  const at::Tensor &bias = *bias_in, &offsets = *offsets_in;
  check_dim(bias, 2, op, "bias");
  check_dtype(bias, gate_up.scalar_type(), op, "bias");
  check_same_device(gate_up, bias, op, "bias");
  TORCH_CHECK_VALUE(bias.size(1) == gate_up.size(1), "tutel::", op, ": `bias` must have shape [experts, ",
                    gate_up.size(1), "] (a row of `gate_up`), got ", bias.sizes());
  const at::Tensor ends = checked_offsets(offsets, gate_up, op);
  TORCH_CHECK_VALUE(ends.size(0) == bias.size(0), "tutel::", op, ": `offsets` must have one end per expert ([",
                    bias.size(0), "], the rows of `bias`), got ", ends.sizes());
  return {rows_with_unit_stride(bias), ends};
}

std::pair<at::Tensor, at::Tensor> checked_gate_and_up(const at::Tensor& gate, const at::Tensor& up,
                                                      const char* op) {
  check_dim(gate, 2, op, "gate");
  check_floating(gate, op, "gate");
  check_dtype(up, gate.scalar_type(), op, "up");
  check_same_device(gate, up, op, "up");
  TORCH_CHECK_VALUE(up.sizes() == gate.sizes(), "tutel::", op, ": `up` must have the shape of `gate` ",
                    gate.sizes(), ", got ", up.sizes());
  return {rows_with_unit_stride(gate), rows_with_unit_stride(up)};
}

at::Tensor checked_unit_grad(const at::Tensor& grad, const at::Tensor& like, int64_t width, const char* op) {
  check_dtype(grad, like.scalar_type(), op, "grad");
  check_same_device(like, grad, op, "grad");
  TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == like.size(0) && grad.size(1) == width, "tutel::", op,
                    ": `grad` must have shape [", like.size(0), ", ", width, "], got ", grad.sizes());
  return rows_with_unit_stride(grad);
}

}  // namespace ops
}  // namespace tutel
