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

}  // namespace ops
}  // namespace tutel
