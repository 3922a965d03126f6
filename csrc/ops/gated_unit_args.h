// Argument checks of tutel::gated_unit, gated_unit_pair and their backward passes for the CUDA
// implementations (csrc/ops/cuda/gated_units_cuda.cpp), with the messages of the CPU ones
// (csrc/ops/cpu/gated_units_cpu.cpp), so that both devices raise the same errors.
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "../core/gated_units.h"

namespace tutel {
namespace ops {

// The unit's parameters, checked (ValueError unless alpha and up_offset are finite and limit is
// None or a finite number > 0); limit None clamps nothing.
core::GatedUnit gated_unit_params(double alpha, double up_offset, const c10::optional<double>& limit,
                                  bool interleaved, const char* op);

// gate_up checked: [n, 2I] floating point; returned as rows the kernels read through a row
// stride (rows_with_unit_stride: a row-strided view stays in place).
at::Tensor checked_gate_up(const at::Tensor& gate_up, const char* op);

// The optional per-expert bias of gated_unit and its backward, checked against gate_up [n, 2I]:
// bias [E, 2I] of gate_up's dtype and device, offsets [E] int32 on that device, both or neither
// (undefined tensors for neither).  The bias is returned as rows like above, offsets contiguous.
// offsets' order is not checked (its values stay on the device); see GatedRows.
std::pair<at::Tensor, at::Tensor> checked_grouped_bias(const c10::optional<at::Tensor>& bias,
                                                       const c10::optional<at::Tensor>& offsets,
                                                       const at::Tensor& gate_up, const char* op);

// Gates and ups ([n, I] each) checked: the same shape, dtype and device; as rows like above.
std::pair<at::Tensor, at::Tensor> checked_gate_and_up(const at::Tensor& gate, const at::Tensor& up, const char* op);

// d h checked: [n, width] of `like`'s dtype and device; as rows like above.
at::Tensor checked_unit_grad(const at::Tensor& grad, const at::Tensor& like, int64_t width, const char* op);

}  // namespace ops
}  // namespace tutel
