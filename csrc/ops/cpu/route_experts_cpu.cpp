// CPU implementation of tutel::route_experts and its backward (csrc/core/route_experts.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "../../core/route_experts.h"
#include "../core_types.h"
#include "../route_experts_args.h"

namespace tutel {
namespace ops {
namespace {

template <class T>
T* optional_ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

RouteExpertsTuple route_experts_cpu(const at::Tensor& logits, int64_t k, c10::string_view score_function,
                                    bool softmax_after_topk, const c10::optional<at::Tensor>& selection_bias,
                                    int64_t n_group, int64_t topk_group, bool renormalize,
                                    double routed_scaling_factor, bool batch_prioritized, int64_t capacity,
                                    bool with_loss) {
  const RouteExpertsArgs a =
      route_experts_args(logits, k, std::string(score_function), softmax_after_topk, selection_bias, n_group,
                         topk_group, renormalize, routed_scaling_factor, batch_prioritized, capacity, with_loss);
  const RouteExpertsOutputs out = allocate_route_experts_outputs(a);
  const core::SelectionBias core_bias = a.selection_bias_pointers();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.logits.scalar_type(), "route_experts", [&] {
    using A = core::acc_t<core_t<scalar_t>>;
    const core::RouteExpertsResult<A> result{
        out.expert_ids.data_ptr<int32_t>(), out.weights.data_ptr<A>(), out.locations.data_ptr<int32_t>(),
        out.counts.data_ptr<int32_t>(), out.dispatch_count.data_ptr<int64_t>(),
        out.grouped_locations.data_ptr<int32_t>(), out.ends.data_ptr<int32_t>(),
        out.row_choices.data_ptr<int32_t>(), out.loss.data_ptr<A>()};
    core::route_experts_forward(core_ptr<scalar_t>(a.logits), a.tokens, a.experts, a.options, core_bias, result);
  });
  return out.as_tuple();
}

at::Tensor route_experts_backward_cpu(const c10::optional<at::Tensor>& grad_weights,
                                      const c10::optional<at::Tensor>& grad_loss, const at::Tensor& logits,
                                      const at::Tensor& expert_ids, const at::Tensor& counts,
                                      c10::string_view score_function, bool softmax_after_topk, bool renormalize,
                                      double routed_scaling_factor, bool with_loss) {
  const RouteExpertsBackwardArgs a =
      route_experts_backward_args(grad_weights, grad_loss, logits, expert_ids, counts, std::string(score_function),
                                  softmax_after_topk, renormalize, routed_scaling_factor, with_loss);
  // The gradient reads the logits of the chosen experts: indices from elsewhere must be in range.
  if (a.expert_ids.numel() > 0) {
    const int64_t smallest = a.expert_ids.min().item<int64_t>(), largest = a.expert_ids.max().item<int64_t>();
    TORCH_CHECK_INDEX(smallest >= 0 && largest < a.experts, "tutel::route_experts_backward: `expert_ids` must lie in [0, ",
                      a.experts, "), got values from ", smallest, " to ", largest);
  }
  at::Tensor grad_logits = at::empty_like(a.logits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.logits.scalar_type(), "route_experts_backward", [&] {
    using A = core::acc_t<core_t<scalar_t>>;
    core::route_experts_backward(optional_ptr<A>(a.grad_weights), optional_ptr<A>(a.grad_loss),
                                 core_ptr<scalar_t>(a.logits), a.tokens, a.experts, a.expert_ids.data_ptr<int32_t>(),
                                 a.counts.data_ptr<int32_t>(), a.options, core_ptr<scalar_t>(grad_logits));
  });
  return grad_logits;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("route_experts", &route_experts_cpu);
  m.impl("route_experts_backward", &route_experts_backward_cpu);
}

}  // namespace ops
}  // namespace tutel
