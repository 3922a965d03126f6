// CUDA implementations of route_topk and assign_locations: top-k selection
// with the per-chunk counts fused in, then the scan and the slot hand-out of
// kernels/slot_assignment.cu; three launches in all (plus a sort for
// batch-prioritized routing), no host synchronisation.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../op_args.h"
#include "cuda_op.h"

namespace tutel {
namespace ops {
namespace cuda_ops {
namespace {

const KernelFamily kRouteTopk{"routing_topk.cu", "route_topk"};
const KernelFamily kPrioritySortKeys{"routing_topk.cu", "priority_sort_keys"};
const KernelFamily kCountChoices{"slot_assignment.cu", "count_choices"};
const KernelFamily kScanChoiceCounts{"slot_assignment.cu", "scan_choice_counts"};
const KernelFamily kAssignSlots{"slot_assignment.cu", "assign_slots"};

// Tokens per chunk of the slot-assignment table [chunks, k, experts]: 64, or
// more when k * experts is large, so the table stays near 4 ints per token.
int64_t chunk_tokens(int64_t k, int64_t experts) {
  return 64 * std::max<int64_t>(1, (k * experts + 255) / 256);
}

// The batch-prioritized claiming order [tokens] int32: descending priority,
// NaN first, equal priorities in token order (a stable sort of order-mapped
// integer keys, so the order does not depend on how the sort treats floats).
at::Tensor priority_order(const CudaOpScope& scope, const at::Tensor& priority) {
  const int64_t tokens = priority.size(0);
  const auto key_dtype = priority.scalar_type() == at::kDouble ? at::kLong : at::kInt;
  at::Tensor keys = at::empty({tokens}, priority.options().dtype(key_dtype));
  cuda::launch_kernel(kPrioritySortKeys.get(scope.device(), data_variant(priority.scalar_type())),
                      {cuda::blocks_for(tokens, TUTEL_BLOCK_THREADS)}, scope.stream(),
                      "priority_sort_keys", input_ptr(priority), tokens, output_ptr(keys));
  const at::Tensor order = std::get<1>(at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  return order.to(at::kInt);
}

// Steps 2 and 3 of slot assignment once chunk_counts is filled.
void assign_from_counts(const CudaOpScope& scope, const at::Tensor& indices, const at::Tensor& order,
                        int64_t experts, int64_t chunk, at::Tensor& chunk_counts,
                        at::Tensor& locations, at::Tensor& counts) {
  const int64_t k = indices.size(0), tokens = indices.size(1);
  const int64_t chunks = cuda::blocks_for(tokens, chunk);
  cuda::launch_kernel(kScanChoiceCounts.get(scope.device()),
                      {cuda::blocks_for(experts * 32, TUTEL_BLOCK_THREADS)}, scope.stream(),
                      "scan_choice_counts", output_ptr(chunk_counts), chunks, k, experts,
                      output_ptr(counts));
  cuda::launch_kernel(kAssignSlots.get(scope.device()),
                      {cuda::blocks_for(chunks, TUTEL_BLOCK_THREADS / 32)}, scope.stream(),
                      "assign_slots", input_ptr(indices), input_ptr(order), tokens, k, experts,
                      chunk, chunks, output_ptr(chunk_counts), output_ptr(locations));
}

// Step 1 for given indices, in token order or in `order`.
void count_choices(const CudaOpScope& scope, const at::Tensor& indices, const at::Tensor& order,
                   int64_t experts, int64_t chunk, at::Tensor& chunk_counts, TutelErrorSink errors) {
  const int64_t k = indices.size(0), tokens = indices.size(1);
  cuda::launch_kernel(kCountChoices.get(scope.device()), {cuda::blocks_for(tokens, chunk)},
                      scope.stream(), "count_choices", input_ptr(indices), input_ptr(order), tokens,
                      k, experts, chunk, output_ptr(chunk_counts), errors);
}

at::Tensor chunk_table(const at::Tensor& like, int64_t tokens, int64_t k, int64_t experts,
                       int64_t chunk) {
  return at::empty({cuda::blocks_for(tokens, chunk) * k * experts}, like.options().dtype(at::kInt));
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
  const int64_t chunk = chunk_tokens(k, a.experts);
  at::Tensor table = chunk_table(a.scores, a.tokens, k, a.experts, chunk);
  at::Tensor order;  // token order unless batch-prioritized
  // Routing made here is trusted: its indices need no reporting.
  cuda::launch_kernel(kRouteTopk.get(scope.device(), data_variant(a.scores.scalar_type())),
                      {cuda::blocks_for(a.tokens, chunk)}, scope.stream(), "route_topk",
                      input_ptr(a.scores), a.tokens, a.experts, k, chunk, output_ptr(indices),
                      output_ptr(gates), batch_prioritized ? nullptr : output_ptr(table));
  if (batch_prioritized && a.tokens > 0) {
    // The top-1 score is each token's priority.
    order = priority_order(scope, gates[0]);
    count_choices(scope, indices, order, a.experts, chunk, table, CudaOpScope::no_reports());
  }
  assign_from_counts(scope, indices, order, a.experts, chunk, table, locations, counts);
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
  const int64_t chunk = chunk_tokens(k, experts);
  at::Tensor table = chunk_table(a.indices, tokens, k, experts, chunk);
  at::Tensor order;
  if (a.priority.defined() && tokens > 0) order = priority_order(scope, a.priority);
  count_choices(scope, a.indices, order, experts, chunk, table, scope.error_sink());
  assign_from_counts(scope, a.indices, order, experts, chunk, table, locations, counts);
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
