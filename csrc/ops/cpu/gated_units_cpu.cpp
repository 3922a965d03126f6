// CPU implementation of gated_unit and its backward (core/gated_units.h): the experts' gated
// activation of [n, 2I] gate/up rows in one pass instead of a chain of elementwise operators.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "../../core/gated_units.h"
#include "../checks.h"
#include "../core_types.h"
#include "reusable_buffers.h"

namespace tutel {
namespace ops {
namespace {

// The unit's parameters, checked: limit None clamps nothing.
core::GatedUnit make_unit(double alpha, double up_offset, const c10::optional<double>& limit, bool interleaved,
                          const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(alpha) && std::isfinite(up_offset), "tutel::", op,
                    ": `alpha` and `up_offset` must be finite, got ", alpha, " and ", up_offset);
  TORCH_CHECK_VALUE(!limit.has_value() || (std::isfinite(*limit) && *limit > 0), "tutel::", op,
                    ": `limit` must be None or a finite number > 0, got ", limit.value_or(0));
  return core::GatedUnit{alpha, up_offset, limit.has_value(), limit.value_or(0), interleaved};
}

// gate_up checked: [n, 2I] floating point, as rows the kernels read (rows_with_unit_stride).
at::Tensor gate_up_rows(const at::Tensor& gate_up, const char* op) {
  check_dim(gate_up, 2, op, "gate_up");
  check_floating(gate_up, op, "gate_up");
  TORCH_CHECK_VALUE(gate_up.size(1) % 2 == 0, "tutel::", op, ": `gate_up` must have an even number of columns ",
                    "(gate and up values), got ", gate_up.size(1));
  return rows_with_unit_stride(gate_up);
}

template <class T>
core::GatedRows<core_t<T>> rows_of(const at::Tensor& gate_up, const at::Tensor& grad, at::Tensor& out) {
  using C = core_t<T>;
  return core::GatedRows<C>{core_ptr<T>(gate_up), gate_up.stride(0),
                            grad.defined() ? core_ptr<T>(grad) : nullptr, grad.defined() ? grad.stride(0) : 0,
                            core_ptr<T>(out), out.stride(0), gate_up.size(0), gate_up.size(1) / 2};
}

at::Tensor gated_unit_cpu(const at::Tensor& gate_up_in, double alpha, double up_offset, c10::optional<double> limit,
                          bool interleaved) {
  const char* op = "gated_unit";
  const core::GatedUnit unit = make_unit(alpha, up_offset, limit, interleaved, op);
  const at::Tensor gate_up = gate_up_rows(gate_up_in, op);
  at::Tensor out = empty_reusable({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gated_unit", [&] {
    core::gated_forward(unit, rows_of<scalar_t>(gate_up, at::Tensor(), out));
  });
  return out;
}

at::Tensor gated_unit_backward_cpu(const at::Tensor& grad_in, const at::Tensor& gate_up_in, double alpha,
                                   double up_offset, c10::optional<double> limit, bool interleaved) {
  const char* op = "gated_unit_backward";
  const core::GatedUnit unit = make_unit(alpha, up_offset, limit, interleaved, op);
  const at::Tensor gate_up = gate_up_rows(gate_up_in, op);
  check_dtype(grad_in, gate_up.scalar_type(), op, "grad");
  check_same_device(gate_up, grad_in, op, "grad");
  TORCH_CHECK_VALUE(grad_in.dim() == 2 && grad_in.size(0) == gate_up.size(0) && grad_in.size(1) == gate_up.size(1) / 2,
                    "tutel::", op, ": `grad` must have shape [", gate_up.size(0), ", ", gate_up.size(1) / 2,
                    "], got ", grad_in.sizes());
  const at::Tensor grad = rows_with_unit_stride(grad_in);
  at::Tensor out = empty_reusable({gate_up.size(0), gate_up.size(1)}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gated_unit_backward", [&] {
    core::gated_backward(unit, rows_of<scalar_t>(gate_up, grad, out));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("gated_unit", &gated_unit_cpu);
  m.impl("gated_unit_backward", &gated_unit_backward_cpu);
}

}  // namespace ops
}  // namespace tutel
