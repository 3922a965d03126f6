// Argument checks of tutel::decode_experts, shared by its CPU and CUDA implementations so that
// both raise the same errors (naming decode_experts and the argument): shapes, dtypes, devices,
// the expert count and the number of choices.  The checked tensors come back in the layouts
// kernels/decode_experts.cu reads.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tutel {
namespace ops {

struct DecodeExpertsArgs {
  at::Tensor x;           // [T, H], unit stride along H (any row stride)
  at::Tensor expert_ids;  // [T, k] int32 or int64, any strides (read as they are)
  at::Tensor weights;     // [T, k] of any floating dtype, any strides, or undefined (weight 1)
  at::Tensor up_weight, down_weight, gate_weight;  // contiguous; gate_weight may be undefined
  at::Tensor up_bias, down_bias;                   // contiguous, or undefined
  int64_t tokens = 0, k = 0, experts = 0, hidden = 0, inter = 0, outputs = 0;
};

// The operator's arguments (schemas.cpp), checked; the data are never read (the CUDA path must
// not synchronise), so ids outside [0, E) are not errors: they are dropped choices.
DecodeExpertsArgs decode_experts_args(const at::Tensor& x, const at::Tensor& expert_ids,
                                      const c10::optional<at::Tensor>& weights, const at::Tensor& up_weight,
                                      const at::Tensor& down_weight, const c10::optional<at::Tensor>& up_bias,
                                      const c10::optional<at::Tensor>& down_bias, bool transposed, double alpha,
                                      double up_offset, c10::optional<double> limit, bool interleaved,
                                      const c10::optional<at::Tensor>& gate_weight);

}  // namespace ops
}  // namespace tutel
