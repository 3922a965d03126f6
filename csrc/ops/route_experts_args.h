// Argument checks of tutel::route_experts and tutel::route_experts_backward, shared by the CPU and
// CUDA implementations so that both raise the same errors; the checked tensors come back contiguous.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

#include "../core/route_experts.h"

namespace tutel {
namespace ops {

struct RouteExpertsArgs {
  at::Tensor logits;          // [tokens, experts]
  at::Tensor selection_bias;  // [experts] float32 / float64, or undefined
  int64_t tokens = 0, experts = 0;
  core::RouteExpertsOptions options;

  // The selection bias as the core and the kernels take it: the pointer of its dtype, the other null.
  core::SelectionBias selection_bias_pointers() const {
    const bool given = selection_bias.defined();
    return {given && selection_bias.scalar_type() == at::kFloat ? selection_bias.data_ptr<float>() : nullptr,
            given && selection_bias.scalar_type() == at::kDouble ? selection_bias.data_ptr<double>() : nullptr};
  }
};

RouteExpertsArgs route_experts_args(const at::Tensor& logits, int64_t k, const std::string& score_function,
                                    bool softmax_after_topk, const c10::optional<at::Tensor>& selection_bias,
                                    int64_t n_group, int64_t topk_group, bool renormalize,
                                    double routed_scaling_factor, bool batch_prioritized, int64_t capacity,
                                    bool with_loss);

// What the forward returns (schemas.cpp), in the order of RouteExpertsOutputs.
using RouteExpertsTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                     at::Tensor, at::Tensor, at::Tensor>;

// The forward's outputs (schemas.cpp), allocated uninitialised on the logits' device.
struct RouteExpertsOutputs {
  at::Tensor expert_ids, weights, locations, counts, dispatch_count, grouped_locations, ends, row_choices, loss;

  RouteExpertsTuple as_tuple() const {
    return {expert_ids, weights, locations, counts, dispatch_count, grouped_locations, ends, row_choices, loss};
  }
};
RouteExpertsOutputs allocate_route_experts_outputs(const RouteExpertsArgs& args);

struct RouteExpertsBackwardArgs {
  at::Tensor grad_weights;  // [k, tokens], or undefined
  at::Tensor grad_loss;     // 0-dim, or undefined
  at::Tensor logits, expert_ids, counts;
  int64_t tokens = 0, experts = 0;
  core::RouteExpertsOptions options;  // k, score, softmax_after_topk, renormalize, scaling, with_loss
};

RouteExpertsBackwardArgs route_experts_backward_args(const c10::optional<at::Tensor>& grad_weights,
                                                     const c10::optional<at::Tensor>& grad_loss,
                                                     const at::Tensor& logits, const at::Tensor& expert_ids,
                                                     const at::Tensor& counts, const std::string& score_function,
                                                     bool softmax_after_topk, bool renormalize,
                                                     double routed_scaling_factor, bool with_loss);

}  // namespace ops
}  // namespace tutel
