// CPU implementations of route_topk and assign_locations.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "../../core/routing.h"
#include "../checks.h"
#include "../core_types.h"

namespace tutel {
namespace ops {
namespace {

void check_token_count(int64_t tokens, const char* op) {
  TORCH_CHECK_VALUE(tokens <= std::numeric_limits<int32_t>::max(), "tutel::", op,
                    ": at most 2^31-1 tokens are supported, got ", tokens);
}

// Fills `order` with the batch-prioritized claiming order for `priority` [T].
void compute_priority_order(const at::Tensor& priority, std::vector<int32_t>& order) {
  order.resize(priority.size(0));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, priority.scalar_type(),
                                  "priority_order", [&] {
                                    core::priority_order(core_ptr<scalar_t>(priority),
                                                         priority.size(0), order.data());
                                  });
}

std::tuple<at::Tensor, at::Tensor> run_assign(const at::Tensor& indices, int64_t experts,
                                              const int32_t* order, const char* op) {
  const int64_t k = indices.size(0), tokens = indices.size(1);
  auto locations = at::empty({k, tokens}, indices.options().dtype(at::kInt));
  auto counts = at::zeros({k, experts}, indices.options().dtype(at::kInt));
  auto status = core::assign_locations(indices.data_ptr<int32_t>(), tokens, k, experts, order,
                                       locations.data_ptr<int32_t>(), counts.data_ptr<int32_t>());
  raise_if_failed(status, op);
  return {locations, counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_topk_cpu(
    const at::Tensor& scores_in, int64_t k, bool batch_prioritized) {
  const char* op = "route_topk";
  check_dim(scores_in, 2, op, "scores");
  check_floating(scores_in, op, "scores");
  const at::Tensor scores = scores_in.contiguous();
  const int64_t tokens = scores.size(0), experts = scores.size(1);
  check_token_count(tokens, op);
  TORCH_CHECK_VALUE(experts >= 1, "tutel::", op, ": scores must have at least one expert column");
  TORCH_CHECK_VALUE(k >= 1 && k <= experts, "tutel::", op, ": k=", k,
                    " is not allowed; k must satisfy 1 <= k <= num_experts=", experts);

  auto indices = at::empty({k, tokens}, scores.options().dtype(at::kInt));
  auto gates = at::empty({k, tokens}, scores.options());
  std::vector<int32_t> order;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "route_topk", [&] {
    core::select_topk(core_ptr<scalar_t>(scores), tokens, experts, k,
                      indices.data_ptr<int32_t>(), core_ptr<scalar_t>(gates));
  });
  // The top-1 score is each token's priority: gates row 0 holds it.
  if (batch_prioritized) compute_priority_order(gates[0], order);
  auto [locations, counts] =
      run_assign(indices, experts, batch_prioritized ? order.data() : nullptr, op);
  return {indices, gates, locations, counts};
}

std::tuple<at::Tensor, at::Tensor> assign_locations_cpu(const at::Tensor& indices_in,
                                                        int64_t experts,
                                                        const c10::optional<at::Tensor>& priority) {
  const char* op = "assign_locations";
  check_dtype(indices_in, at::kInt, op, "indices");
  check_dim(indices_in, 2, op, "indices");
  check_token_count(indices_in.size(1), op);
  TORCH_CHECK_VALUE(experts >= 1 && experts <= std::numeric_limits<int32_t>::max(), "tutel::", op,
                    ": num_experts=", experts, " must be in [1, 2^31-1]");
  const at::Tensor indices = indices_in.contiguous();
  std::vector<int32_t> order;
  if (priority.has_value()) {
    check_dim(*priority, 1, op, "priority");
    check_floating(*priority, op, "priority");
    TORCH_CHECK_VALUE(priority->size(0) == indices.size(1), "tutel::", op,
                      ": `priority` must have one entry per token (", indices.size(1), "), got ",
                      priority->size(0));
    compute_priority_order(priority->contiguous(), order);
  }
  return run_assign(indices, experts, priority.has_value() ? order.data() : nullptr, op);
}

}  // namespace

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("route_topk", &route_topk_cpu);
  m.impl("assign_locations", &assign_locations_cpu);
}

}  // namespace ops
}  // namespace tutel
