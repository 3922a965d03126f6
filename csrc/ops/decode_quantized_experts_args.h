// Argument checks of tutel::decode_quantized_experts (schemas.cpp): the format and the unit by
// name, every tensor's dtype, shape and device against the format's layout, naming the operator
// and the argument.  The checked tensors come back in the layouts the core kernels read
// (core/quantized_decode.h): contiguous, ids as int64, routing weights and scales as float32;
// with routing_as_given, the ids and routing weights come back as they were passed (the CUDA
// kernels read any of their dtypes and strides, so the call converts nothing on the device).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "../core/quantized_decode.h"
#include "quantized_stack_args.h"

namespace tutel {
namespace ops {

struct DecodeQuantizedExpertsArgs {
  core::QuantFormat format = core::QuantFormat::kMxfp4;
  core::ExpertUnit unit;
  at::Tensor x;           // [T, H], unit stride along H
  at::Tensor expert_ids;  // [T, k] int64, contiguous (routing_as_given: int32 or int64, any strides)
  at::Tensor weights;     // [T, k] float32, contiguous (routing_as_given: any floating dtype and strides),
                          // or undefined (weight 1)
  QuantizedStackArgs gate_up, down;
  at::Tensor gate_up_bias, down_bias;  // float32 contiguous, or undefined
  int64_t tokens = 0, k = 0, experts = 0, hidden = 0, inter = 0, outputs = 0;
  int64_t block_rows = 1, block_cols = 1;  // fp8_block's scale block
};

DecodeQuantizedExpertsArgs decode_quantized_experts_args(
    const at::Tensor& x, const at::Tensor& expert_ids, const c10::optional<at::Tensor>& weights,
    const std::string& format, const at::Tensor& gate_up, const at::Tensor& gate_up_scales,
    const c10::optional<at::Tensor>& gate_up_global, const at::Tensor& down, const at::Tensor& down_scales,
    const c10::optional<at::Tensor>& down_global, at::IntArrayRef block, const c10::optional<at::Tensor>& gate_up_bias,
    const c10::optional<at::Tensor>& down_bias, const std::string& activation, double alpha, double up_offset,
    c10::optional<double> limit, bool interleaved, bool routing_as_given = false);

}  // namespace ops
}  // namespace tutel
