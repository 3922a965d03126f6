// The CPU dropless grouping, for other CPU operators that run it inside one call.
#pragma once

#include <ATen/ATen.h>

namespace tutel {
namespace ops {

// tutel::group_by_expert's grouping (schemas.cpp) written into the caller's contiguous arrays,
// locations [k, T], slot_choices [T k], sorted_ids [T k], counts [E], ends [E], for an operator
// that keeps it inside one call: no tensors allocated.  `expert_ids` is [T, k] of any integer
// dtype; the caller has checked it.
void group_by_expert_into(const at::Tensor& expert_ids, int64_t experts, int32_t* locations, int64_t* slot_choices,
                          int64_t* sorted_ids, int64_t* counts, int32_t* ends);

}  // namespace ops
}  // namespace tutel
