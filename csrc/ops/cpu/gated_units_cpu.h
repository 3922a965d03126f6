// The CPU gated unit, for other CPU operators that run it inside one call.
#pragma once

#include <ATen/ATen.h>

namespace tutel {
namespace ops {

// tutel::gated_unit on CPU (schemas.cpp): gate_up [n, 2I] -> h [n, I], with the per-expert bias
// of grouped rows when bias and offsets are given.
at::Tensor gated_unit_cpu(const at::Tensor& gate_up, double alpha, double up_offset, c10::optional<double> limit,
                          bool interleaved, const c10::optional<at::Tensor>& bias = c10::nullopt,
                          const c10::optional<at::Tensor>& offsets = c10::nullopt);

// tutel::gated_unit_pair on CPU: gate [n, I] and up [n, I] -> h [n, I].
at::Tensor gated_unit_pair_cpu(const at::Tensor& gate, const at::Tensor& up, double alpha, double up_offset,
                               c10::optional<double> limit);

}  // namespace ops
}  // namespace tutel
