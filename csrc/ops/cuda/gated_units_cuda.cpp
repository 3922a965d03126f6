// CUDA implementations of gated_unit, gated_unit_pair and their backward passes: one launch of
// kernels/gated_units.cu each (with or without gated_unit's per-expert bias), no host
// synchronisation.  Row-strided views (one half of a fused product) are read in place; the
// outputs are new contiguous tensors.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <utility>

#include "../gated_unit_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::gated_unit_forward> kForward;
const Kernel<cuda::kernels::gated_unit_backward> kBackward;

TutelGatedUnit kernel_unit(const core::GatedUnit& unit) {
  return TutelGatedUnit{unit.alpha, unit.up_offset, unit.limit, unit.clamped ? 1 : 0};
}

// The address `elements` elements past t's data (nullptr for an empty tensor).
const void* shifted(const at::Tensor& t, int64_t elements) {
  const char* base = static_cast<const char*>(input_ptr(t));
  return base == nullptr ? nullptr : base + elements * t.element_size();
}

// gate_up [n, 2I]: the two halves of each row, or alternating values (interleaved); with the
// per-expert bias when `bias` (checked_grouped_bias: bias rows and offsets) is defined and has
// experts.  A bias row has gate_up's layout, so its halves are found as gate_up's are.
TutelGatedOperands concatenated(const at::Tensor& gate_up, bool interleaved,
                                const std::pair<at::Tensor, at::Tensor>& bias) {
  const int64_t width = gate_up.size(1) / 2, up_shift = interleaved ? 1 : width;
  TutelGatedOperands operands{input_ptr(gate_up), gate_up.stride(0), shifted(gate_up, up_shift), gate_up.stride(0),
                              interleaved ? 2 : 1, gate_up.size(0), width, nullptr, nullptr, 0, nullptr, 0};
  if (bias.first.defined() && bias.first.size(0) > 0) {
    operands.gate_bias = input_ptr(bias.first);
    operands.up_bias = shifted(bias.first, up_shift);
    operands.bias_stride = bias.first.stride(0);
    operands.expert_ends = static_cast<const int*>(input_ptr(bias.second));
    operands.experts = bias.first.size(0);
  }
  return operands;
}

// Separate gates and ups [n, I] (no bias).
TutelGatedOperands separate(const at::Tensor& gate, const at::Tensor& up) {
  return TutelGatedOperands{input_ptr(gate), gate.stride(0), input_ptr(up), up.stride(0), 1, gate.size(0),
                            gate.size(1), nullptr, nullptr, 0, nullptr, 0};
}

// h [n, I], a new tensor like `like` (the operands' dtype and device).
at::Tensor forward(const at::Tensor& like, const TutelGatedOperands& operands, const core::GatedUnit& unit,
                   const char* op) {
  at::Tensor out = at::empty({operands.rows, operands.width}, like.options());
  CudaOpScope scope(like);
  cuda::launch_kernel(kForward.get(scope.device(), data_variant(like.scalar_type())),
                      cuda::plan_gated_units(operands.rows, operands.width), scope.stream(), op, operands,
                      output_ptr(out), out.stride(0), kernel_unit(unit));
  return out;
}

// d gate and d up into rows at d_gate and d_up (each with its row stride, the operands' step
// between units), from d h.
void backward(const at::Tensor& like, const TutelGatedOperands& operands, const at::Tensor& grad, void* d_gate,
              int64_t d_gate_stride, void* d_up, int64_t d_up_stride, const core::GatedUnit& unit, const char* op) {
  CudaOpScope scope(like);
  cuda::launch_kernel(kBackward.get(scope.device(), data_variant(like.scalar_type())),
                      cuda::plan_gated_units(operands.rows, operands.width), scope.stream(), op, operands,
                      input_ptr(grad), grad.stride(0), d_gate, d_gate_stride, d_up, d_up_stride, kernel_unit(unit));
}

at::Tensor gated_unit_cuda(const at::Tensor& gate_up_in, double alpha, double up_offset, c10::optional<double> limit,
                           bool interleaved, const c10::optional<at::Tensor>& bias_in,
                           const c10::optional<at::Tensor>& offsets_in) {
  const char* op = "gated_unit";
  const core::GatedUnit unit = gated_unit_params(alpha, up_offset, limit, interleaved, op);
  const at::Tensor gate_up = checked_gate_up(gate_up_in, op);
  const std::pair<at::Tensor, at::Tensor> bias = checked_grouped_bias(bias_in, offsets_in, gate_up, op);
  return forward(gate_up, concatenated(gate_up, interleaved, bias), unit, op);
}

at::Tensor gated_unit_backward_cuda(const at::Tensor& grad_in, const at::Tensor& gate_up_in, double alpha,
                                    double up_offset, c10::optional<double> limit, bool interleaved,
                                    const c10::optional<at::Tensor>& bias_in,
                                    const c10::optional<at::Tensor>& offsets_in) {
  const char* op = "gated_unit_backward";
  const core::GatedUnit unit = gated_unit_params(alpha, up_offset, limit, interleaved, op);
  const at::Tensor gate_up = checked_gate_up(gate_up_in, op);
  const at::Tensor grad = checked_unit_grad(grad_in, gate_up, gate_up.size(1) / 2, op);
  const std::pair<at::Tensor, at::Tensor> bias = checked_grouped_bias(bias_in, offsets_in, gate_up, op);
  const TutelGatedOperands operands = concatenated(gate_up, interleaved, bias);
  // d gate_up in gate_up's layout: every element is written (a gate or an up of some unit).
  at::Tensor out = at::empty(gate_up.sizes(), gate_up.options());
  void* d_gate = output_ptr(out);
  void* d_up = const_cast<void*>(shifted(out, interleaved ? 1 : operands.width));
  backward(gate_up, operands, grad, d_gate, out.stride(0), d_up, out.stride(0), unit, op);
  return out;
}

at::Tensor gated_unit_pair_cuda(const at::Tensor& gate_in, const at::Tensor& up_in, double alpha, double up_offset,
                                c10::optional<double> limit) {
  const char* op = "gated_unit_pair";
  const core::GatedUnit unit = gated_unit_params(alpha, up_offset, limit, false, op);
  const std::pair<at::Tensor, at::Tensor> rows = checked_gate_and_up(gate_in, up_in, op);
  return forward(rows.first, separate(rows.first, rows.second), unit, op);
}

std::tuple<at::Tensor, at::Tensor> gated_unit_pair_backward_cuda(const at::Tensor& grad_in, const at::Tensor& gate_in,
                                                                 const at::Tensor& up_in, double alpha,
                                                                 double up_offset, c10::optional<double> limit) {
  const char* op = "gated_unit_pair_backward";
  const core::GatedUnit unit = gated_unit_params(alpha, up_offset, limit, false, op);
  const std::pair<at::Tensor, at::Tensor> rows = checked_gate_and_up(gate_in, up_in, op);
  const at::Tensor &gate = rows.first, &up = rows.second;
  const at::Tensor grad = checked_unit_grad(grad_in, gate, gate.size(1), op);
  at::Tensor d_gate = at::empty(gate.sizes(), gate.options());
  at::Tensor d_up = at::empty(gate.sizes(), gate.options());
  backward(gate, separate(gate, up), grad, output_ptr(d_gate), d_gate.stride(0), output_ptr(d_up), d_up.stride(0),
           unit, op);
  return {d_gate, d_up};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) {
  m.impl("gated_unit", &gated_unit_cuda);
  m.impl("gated_unit_backward", &gated_unit_backward_cuda);
  m.impl("gated_unit_pair", &gated_unit_pair_cuda);
  m.impl("gated_unit_pair_backward", &gated_unit_pair_backward_cuda);
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
