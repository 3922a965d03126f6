// CPU implementation of gated_unit and its backward (core/gated_units.h): the experts' gated
// activation of [n, 2I] gate/up rows in one pass instead of a chain of elementwise operators.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <utility>

#include "../../core/gated_units.h"
#include "../checks.h"
#include "../core_types.h"
#include "../gated_unit_args.h"
#include "gated_units_cpu.h"
#include "reusable_buffers.h"

namespace tutel {
namespace ops {
namespace {

template <class T>
using CoreRows = core::GatedRows<core_t<T>>;

// gate_up's rows, with the per-expert bias when `bias` (checked_grouped_bias) is defined.
template <class T>
CoreRows<T> concatenated_rows(bool interleaved, const at::Tensor& gate_up, const at::Tensor& grad, at::Tensor& h,
                              at::Tensor& d_gate_up, const std::pair<at::Tensor, at::Tensor>& bias) {
  const CoreRows<T> rows = core::concatenated_gate_up<core_t<T>>(
      interleaved, core_ptr<T>(gate_up), gate_up.stride(0), grad.defined() ? core_ptr<T>(grad) : nullptr,
      grad.defined() ? grad.stride(0) : 0, h.defined() ? core_ptr<T>(h) : nullptr, h.defined() ? h.stride(0) : 0,
      d_gate_up.defined() ? core_ptr<T>(d_gate_up) : nullptr, d_gate_up.defined() ? d_gate_up.stride(0) : 0,
      gate_up.size(0), gate_up.size(1) / 2);
  if (!bias.first.defined() || bias.first.size(0) == 0) return rows;  // no experts: no row takes a bias
  return core::with_grouped_bias<core_t<T>>(rows, interleaved, core_ptr<T>(bias.first), bias.first.stride(0),
                                            bias.second.data_ptr<int32_t>(), bias.first.size(0));
}

// Separate gates and ups; `out` is h (forward) or d gate (backward, with d_up).
template <class T>
CoreRows<T> separate_rows(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& grad, at::Tensor& out,
                          at::Tensor& d_up) {
  return CoreRows<T>{core_ptr<T>(gate), gate.stride(0), core_ptr<T>(up), up.stride(0),
                     grad.defined() ? core_ptr<T>(grad) : nullptr, grad.defined() ? grad.stride(0) : 0,
                     core_ptr<T>(out), out.stride(0), d_up.defined() ? core_ptr<T>(d_up) : nullptr,
                     d_up.defined() ? d_up.stride(0) : 0, gate.size(0), gate.size(1)};
}

}  // namespace

at::Tensor gated_unit_cpu(const at::Tensor& gate_up_in, double alpha, double up_offset, c10::optional<double> limit,
                          bool interleaved, const c10::optional<at::Tensor>& bias_in,
                          const c10::optional<at::Tensor>& offsets_in) {
  const char* op = "gated_unit";
  const core::GatedUnit unit = gated_unit_params(alpha, up_offset, limit, interleaved, op);
  const at::Tensor gate_up = checked_gate_up(gate_up_in, op);
  const std::pair<at::Tensor, at::Tensor> bias = checked_grouped_bias(bias_in, offsets_in, gate_up, op);
  at::Tensor out = empty_reusable({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options()), none;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gated_unit", [&] {
    core::gated_forward(unit, concatenated_rows<scalar_t>(interleaved, gate_up, at::Tensor(), out, none, bias));
  });
  return out;
}

namespace {

at::Tensor gated_unit_backward_cpu(const at::Tensor& grad_in, const at::Tensor& gate_up_in, double alpha,
                                   double up_offset, c10::optional<double> limit, bool interleaved,
                                   const c10::optional<at::Tensor>& bias_in,
                                   const c10::optional<at::Tensor>& offsets_in) {
  const char* op = "gated_unit_backward";
  const core::GatedUnit unit = gated_unit_params(alpha, up_offset, limit, interleaved, op);
  const at::Tensor gate_up = checked_gate_up(gate_up_in, op);
  const at::Tensor grad = checked_unit_grad(grad_in, gate_up, gate_up.size(1) / 2, op);
  const std::pair<at::Tensor, at::Tensor> bias = checked_grouped_bias(bias_in, offsets_in, gate_up, op);
  at::Tensor out = empty_reusable({gate_up.size(0), gate_up.size(1)}, gate_up.options()), none;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gated_unit_backward", [&] {
    core::gated_backward(unit, concatenated_rows<scalar_t>(interleaved, gate_up, grad, none, out, bias));
  });
  return out;
}

}  // namespace

at::Tensor gated_unit_pair_cpu(const at::Tensor& gate_in, const at::Tensor& up_in, double alpha, double up_offset,
                               c10::optional<double> limit) {
  const char* op = "gated_unit_pair";
  const core::GatedUnit unit = gated_unit_params(alpha, up_offset, limit, false, op);
  // Named references, not structured bindings: lambdas capture those only from C++20.
  const std::pair<at::Tensor, at::Tensor> rows = checked_gate_and_up(gate_in, up_in, op);
  const at::Tensor &gate = rows.first, &up = rows.second;
  at::Tensor out = empty_reusable(gate.sizes(), gate.options()), none;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "gated_unit_pair", [&] {
    core::gated_forward(unit, separate_rows<scalar_t>(gate, up, at::Tensor(), out, none));
  });
  return out;
}

namespace {

std::tuple<at::Tensor, at::Tensor> gated_unit_pair_backward_cpu(const at::Tensor& grad_in, const at::Tensor& gate_in,
                                                                const at::Tensor& up_in, double alpha,
                                                                double up_offset, c10::optional<double> limit) {
  const char* op = "gated_unit_pair_backward";
  const core::GatedUnit unit = gated_unit_params(alpha, up_offset, limit, false, op);
  const std::pair<at::Tensor, at::Tensor> rows = checked_gate_and_up(gate_in, up_in, op);
  const at::Tensor &gate = rows.first, &up = rows.second;
  const at::Tensor grad = checked_unit_grad(grad_in, gate, gate.size(1), op);
  at::Tensor d_gate = empty_reusable(gate.sizes(), gate.options());
  at::Tensor d_up = empty_reusable(gate.sizes(), gate.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "gated_unit_pair_backward", [&] {
    core::gated_backward(unit, separate_rows<scalar_t>(gate, up, grad, d_gate, d_up));
  });
  return {d_gate, d_up};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("gated_unit", &gated_unit_cpu);
  m.impl("gated_unit_backward", &gated_unit_backward_cpu);
  m.impl("gated_unit_pair", &gated_unit_pair_cpu);
  m.impl("gated_unit_pair_backward", &gated_unit_pair_backward_cpu);
}

}  // namespace ops
}  // namespace tutel
