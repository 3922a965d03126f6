// CUDA implementations of route_topk and assign_locations: top-k selection
// with the per-chunk counts fused in, then the scan and the slot hand-out of
// kernels/slot_assignment.cu; three launches in all (plus a sort for
// batch-prioritized routing), no host synchronisation.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "../op_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const Kernel<cuda::kernels::route_topk> kRouteTopk;
const Kernel<cuda::kernels::priority_sort_keys> kPrioritySortKeys;
const Kernel<cuda::kernels::count_choices> kCountChoices;
const Kernel<cuda::kernels::scan_choice_counts> kScanChoiceCounts;
const Kernel<cuda::kernels::assign_slots> kAssignSlots;

// The batch-prioritized claiming order [tokens] int32: descending priority,
// NaN first, equal priorities in token order (a stable sort of order-mapped
// integer keys, so the order does not depend on how the sort treats floats).
at::Tensor priority_order(const CudaOpScope& scope, const at::Tensor& priority) {
  const int64_t tokens = priority.size(0);
  const auto key_dtype = priority.scalar_type() == at::kDouble ? at::kLong : at::kInt;
  at::Tensor keys = at::empty({tokens}, priority.options().dtype(key_dtype));
  cuda::launch_kernel(kPrioritySortKeys.get(scope.device(), data_variant(priority.scalar_type())),
                      cuda::plan_priority_keys(tokens), scope.stream(), "priority_sort_keys",
                      input_ptr(priority), tokens, output_ptr(keys));
  const at::Tensor order = std::get<1>(at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  return order.to(at::kInt);
}

// Steps 2 and 3 of slot assignment once the plan's table is filled.
void assign_from_counts(const CudaOpScope& scope, const at::Tensor& indices, const at::Tensor& order,
                        int64_t experts, const cuda::SlotAssignmentPlan& plan, at::Tensor& table,
                        at::Tensor& locations, at::Tensor& counts) {
  const int64_t k = indices.size(0), tokens = indices.size(1);
  cuda::launch_kernel(kScanChoiceCounts.get(scope.device()), plan.scan_grid, scope.stream(),
                      "scan_choice_counts", output_ptr(table), plan.chunks, k, experts,
                      output_ptr(counts));
  cuda::launch_kernel(kAssignSlots.get(scope.device()), plan.assign_grid, scope.stream(),
                      "assign_slots", input_ptr(indices), input_ptr(order), tokens, k, experts,
                      plan.chunk_tokens, plan.chunks, output_ptr(table), output_ptr(locations));
}

// Step 1 for given indices, in token order or in `order`.
void count_choices(const CudaOpScope& scope, const at::Tensor& indices, const at::Tensor& order,
                   int64_t experts, const cuda::SlotAssignmentPlan& plan, at::Tensor& table,
                   TutelErrorSink errors) {
  const int64_t k = indices.size(0), tokens = indices.size(1);
  cuda::launch_kernel(kCountChoices.get(scope.device()), plan.chunk_grid, scope.stream(),
                      "count_choices", input_ptr(indices), input_ptr(order), tokens, k, experts,
                      plan.chunk_tokens, output_ptr(table), errors);
}

at::Tensor chunk_table(const at::Tensor& like, const cuda::SlotAssignmentPlan& plan) {
  return at::empty({plan.table_ints}, like.options().dtype(at::kInt));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_topk_cuda(
    const at::Tensor& scores_in, int64_t k, bool batch_prioritized) {
  const RouteTopkArgs a = route_topk_args(scores_in, k);
  check_choice_count(k, a.tokens, "route_topk");
  CudaOpScope scope(a.scores);
  auto int_options = a.scores.options().dtype(at::kInt);
  at::Tensor indices = at::empty({k, a.tokens}, int_options);
  at::Tensor gates = at::empty({k, a.tokens}, a.scores.options());
  at::Tensor locations = at::empty({k, a.tokens}, int_options);
  at::Tensor counts = at::empty({k, a.experts}, int_options);
  const cuda::SlotAssignmentPlan plan = cuda::plan_slot_assignment(a.tokens, k, a.experts);
  at::Tensor table = chunk_table(a.scores, plan);
  at::Tensor order;  // token order unless batch-prioritized
  // Routing made here is trusted: its indices need no reporting.
  cuda::launch_kernel(kRouteTopk.get(scope.device(), data_variant(a.scores.scalar_type())),
                      plan.chunk_grid, scope.stream(), "route_topk", input_ptr(a.scores),
                      a.tokens, a.experts, k, plan.chunk_tokens, output_ptr(indices),
                      output_ptr(gates), batch_prioritized ? nullptr : output_ptr(table));
  if (batch_prioritized && a.tokens > 0) {
    // The top-1 score is each token's priority.
    order = priority_order(scope, gates[0]);
    count_choices(scope, indices, order, a.experts, plan, table, CudaOpScope::no_reports());
  }
  assign_from_counts(scope, indices, order, a.experts, plan, table, locations, counts);
  return {indices, gates, locations, counts};
}

std::tuple<at::Tensor, at::Tensor> assign_locations_cuda(const at::Tensor& indices_in,
                                                         int64_t experts,
                                                         const c10::optional<at::Tensor>& priority) {
  const AssignArgs a = assign_locations_args(indices_in, experts, priority);
  const int64_t k = a.indices.size(0), tokens = a.indices.size(1);
  check_choice_count(k, tokens, "assign_locations");
  CudaOpScope scope(a.indices);
  at::Tensor locations = at::empty({k, tokens}, a.indices.options());
  at::Tensor counts = at::empty({k, experts}, a.indices.options());
  const cuda::SlotAssignmentPlan plan = cuda::plan_slot_assignment(tokens, k, experts);
  at::Tensor table = chunk_table(a.indices, plan);
  at::Tensor order;
  if (a.priority.defined() && tokens > 0) order = priority_order(scope, a.priority);
  count_choices(scope, a.indices, order, experts, plan, table, scope.error_sink());
  assign_from_counts(scope, a.indices, order, experts, plan, table, locations, counts);
  return {locations, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CUDA, m) {
  m.impl("route_topk", &route_topk_cuda);
  m.impl("assign_locations", &assign_locations_cuda);
}

}  // namespace cuda_ops
}  // namespace ops
}  // namespace tutel
