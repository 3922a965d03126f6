// The CPU dropless grouping, for other CPU operators that run it inside one call.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace tutel {
namespace ops {

// tutel::group_by_expert on CPU (schemas.cpp): expert_ids [T, k] -> (locations [k, T] int32,
// slot_choices [T k] int64, sorted_ids [T k] int64, counts [E] int64, ends [E] int32).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_by_expert_cpu(
    const at::Tensor& expert_ids, int64_t experts);

// The same grouping written into the caller's arrays (of the sizes above, contiguous), for an
// operator that keeps it inside one call: no tensors allocated.  `expert_ids` is [T, k] of any
// integer dtype; the caller has checked it.
void group_by_expert_into(const at::Tensor& expert_ids, int64_t experts, int32_t* locations, int64_t* slot_choices,
                          int64_t* sorted_ids, int64_t* counts, int32_t* ends);

}  // namespace ops
}  // namespace tutel
