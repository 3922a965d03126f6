// CUDA implementation of tutel::route_experts (two launches of kernels/route_experts.cu, no host
// synchronisation: every size comes from the shapes and int arguments) and of its backward (one
// launch).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "../route_experts_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::route_experts_route> kRoute;
const Kernel<cuda::kernels::route_experts_plan> kPlan;
const Kernel<cuda::kernels::route_experts_backward> kBackward;

RouteExpertsTuple route_experts_cuda(const at::Tensor& logits, int64_t k, c10::string_view score_function,
                                     bool softmax_after_topk, const c10::optional<at::Tensor>& selection_bias,
                                     int64_t n_group, int64_t topk_group, bool renormalize,
                                     double routed_scaling_factor, bool batch_prioritized, int64_t capacity,
                                     bool with_loss) {
  const RouteExpertsArgs a =
      route_experts_args(logits, k, std::string(score_function), softmax_after_topk, selection_bias, n_group,
                         topk_group, renormalize, routed_scaling_factor, batch_prioritized, capacity, with_loss);
  CudaOpScope scope(a.logits);
  const RouteExpertsOutputs out = allocate_route_experts_outputs(a);
  const core::RouteExpertsOptions& o = a.options;
  const bool prioritized = o.batch_prioritized && a.tokens > 0, loss = o.with_loss && a.tokens > 0;
  const cuda::RouteExpertsPlan plan = cuda::plan_route_experts(a.tokens, a.experts, o.k, o.capacity, prioritized, loss);
  const auto options = a.logits.options();
  // Scratch (see launch_plan.h); route_experts_route zeroes the phase counters at its front.
  at::Tensor workspace = at::empty({plan.int_workspace_ints}, options.dtype(at::kInt));
  at::Tensor acc_workspace = at::empty({plan.acc_workspace}, out.weights.options());
  at::Tensor keys = at::empty({plan.key_workspace}, options.dtype(a.logits.scalar_type() == at::kDouble ? at::kLong : at::kInt));
  int* sync = workspace.data_ptr<int>();
  int* table = sync + TUTEL_ROUTE_SYNC_INTS;
  int* run_tokens = prioritized ? table + plan.table_ints : nullptr;
  int* order = prioritized ? run_tokens + a.tokens : nullptr;
  char* acc = loss ? static_cast<char*>(acc_workspace.data_ptr()) : nullptr;
  void* chunk_sums = acc;
  void* column_sums = loss ? acc + plan.chunks * a.experts * acc_workspace.element_size() : nullptr;
  const core::SelectionBias bias = a.selection_bias_pointers();
  const Variant variant = data_variant(a.logits.scalar_type());
  const int score = static_cast<int>(o.score), after_topk = o.softmax_after_topk, renorm = o.renormalize,
            loss_flag = loss, prioritized_flag = prioritized;
  cuda::launch_kernel(kRoute.get(scope.device(), variant), plan.route_grid, scope.stream(), "route_experts_route",
                      input_ptr(a.logits), a.tokens, a.experts, o.k, score, after_topk, bias.f32, bias.f64, o.n_group,
                      o.topk_group, renorm, o.routed_scaling_factor, loss_flag, prioritized_flag, plan.chunk_tokens,
                      output_ptr(out.expert_ids), output_ptr(out.weights), table, chunk_sums, output_ptr(keys),
                      run_tokens, sync);
  cuda::launch_kernel(kPlan.get(scope.device(), variant), plan.plan_grid, scope.stream(), "route_experts_plan",
                      a.tokens, a.experts, o.k, o.capacity, plan.chunk_tokens, plan.chunks, plan.rows, loss_flag,
                      prioritized_flag, plan.rank_blocks, plan.count_blocks, plan.assign_blocks,
                      input_ptr(out.expert_ids), table, static_cast<const void*>(chunk_sums), input_ptr(keys),
                      static_cast<const int*>(run_tokens), order, column_sums, sync, output_ptr(out.counts),
                      output_ptr(out.dispatch_count), output_ptr(out.ends), output_ptr(out.loss),
                      output_ptr(out.locations), output_ptr(out.grouped_locations), output_ptr(out.row_choices));
  return out.as_tuple();
}

// `expert_ids` must be the forward's (the kernel reads the logits they name unchecked).
at::Tensor route_experts_backward_cuda(const c10::optional<at::Tensor>& grad_weights,
                                       const c10::optional<at::Tensor>& grad_loss, const at::Tensor& logits,
                                       const at::Tensor& expert_ids, const at::Tensor& counts,
                                       c10::string_view score_function, bool softmax_after_topk, bool renormalize,
                                       double routed_scaling_factor, bool with_loss) {
  const RouteExpertsBackwardArgs a =
      route_experts_backward_args(grad_weights, grad_loss, logits, expert_ids, counts, std::string(score_function),
                                  softmax_after_topk, renormalize, routed_scaling_factor, with_loss);
  CudaOpScope scope(a.logits);
  at::Tensor grad_logits = at::empty_like(a.logits);
  const core::RouteExpertsOptions& o = a.options;
  const int score = static_cast<int>(o.score), after_topk = o.softmax_after_topk, renorm = o.renormalize,
            loss = o.with_loss && a.grad_loss.defined() && a.tokens > 0;
  cuda::launch_kernel(kBackward.get(scope.device(), data_variant(a.logits.scalar_type())),
                      cuda::plan_route_experts_backward(a.tokens), scope.stream(), "route_experts_backward",
                      input_ptr(a.grad_weights), input_ptr(a.grad_loss), input_ptr(a.logits), a.tokens, a.experts,
                      o.k, input_ptr(a.expert_ids), input_ptr(a.counts), score, after_topk, renorm,
                      o.routed_scaling_factor, loss, output_ptr(grad_logits));
  return grad_logits;
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) {
  m.impl("route_experts", &route_experts_cuda);
  m.impl("route_experts_backward", &route_experts_backward_cuda);
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
