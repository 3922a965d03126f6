// Argument checks of each operator, shared by its CPU and CUDA
// implementations so that both give the same messages; the checked inputs
// come back contiguous.
#pragma once

#include <ATen/ATen.h>

#include "../core/choice_weights.h"
#include "checks.h"

namespace tutel {
namespace ops {

struct RouteTopkArgs {
  at::Tensor scores;  // [tokens, experts]
  int64_t tokens;
  int64_t experts;
};
RouteTopkArgs route_topk_args(const at::Tensor& scores, int64_t k);

struct AssignArgs {
  at::Tensor indices;   // [k, tokens] int32
  at::Tensor priority;  // [tokens], or undefined
};
AssignArgs assign_locations_args(const at::Tensor& indices, int64_t experts,
                                 const c10::optional<at::Tensor>& priority);

// gather_slots and scatter_slots.
struct SlotArgs {
  at::Tensor data;       // rows [E, C, M] (gather) or src [T, M] (scatter)
  at::Tensor indices;    // [k, T] int32, or undefined: every choice's expert is 0 (the grouped layout)
  at::Tensor locations;  // [k, T] int32
  at::Tensor weights;    // [k, T] of any floating dtype and any strides (read in place), or undefined
  at::Tensor other;               // [T, M] (gather) or [E, C, M] (scatter), or undefined
  int64_t k, tokens, experts, capacity, model_dim;
};
SlotArgs gather_slots_args(const at::Tensor& rows, const c10::optional<at::Tensor>& indices,
                           const at::Tensor& locations, const c10::optional<at::Tensor>& weights,
                           const c10::optional<at::Tensor>& other);
SlotArgs scatter_slots_args(const at::Tensor& src, const c10::optional<at::Tensor>& indices,
                            const at::Tensor& locations, const c10::optional<at::Tensor>& weights,
                            const c10::optional<at::Tensor>& other, int64_t experts,
                            int64_t capacity);

// SlotArgs::weights as the kernels read them in place (no data: weight 1).
core::ChoiceWeights choice_weights(const at::Tensor& weights);

// The dots output: [k, T] in the accumulation dtype when `other` is given,
// else an empty tensor.
at::Tensor make_dots(const SlotArgs& args);

// cumsum_sub_one's result dtype for a mask of `dtype` (as torch.cumsum:
// integers and bool give int64); throws TypeError for other dtypes.
at::ScalarType cumsum_output_dtype(at::ScalarType dtype);

}  // namespace ops
}  // namespace tutel
