// Argument checks of tutel::group_by_expert for the CUDA implementation
// (csrc/ops/cuda/group_by_expert_cuda.cpp), with the messages of the CPU one
// (csrc/ops/cpu/routing_cpu.cpp), so that both devices raise the same errors.
#pragma once

#include <ATen/ATen.h>

namespace tutel {
namespace ops {

// Checks expert_ids ([T, k], integers, not bool), num_experts (>= 1) and the sizes the int32
// locations and slots allow (T k and E below 2^31).  Returns the ids as the kernels read them,
// in place through their strides: itself for int32 and int64, else widened to int64 as the CPU
// operator widens them.
at::Tensor checked_group_by_expert_ids(const at::Tensor& expert_ids, int64_t num_experts);

}  // namespace ops
}  // namespace tutel
