// The routed choices of a decode call as the decode kernels read them (kernels/decode_routing.cuh),
// shared by decode_experts and decode_quantized_experts: the expert ids and routing weights as the
// caller passed them (int32 or int64 ids, weights of any floating dtype, any strides), so that no
// conversion launch precedes the kernels.
#pragma once

#include <ATen/ATen.h>

#include "../../cuda/expert_launch_plan.h"

namespace tutel {
namespace ops {
namespace cuda_ops {

// `weights` undefined means weight 1 for every choice.
TutelDecodeRouting decode_routing(const at::Tensor& expert_ids, const at::Tensor& weights, int64_t tokens, int64_t k,
                                  int64_t experts);

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
