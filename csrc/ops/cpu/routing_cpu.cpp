// CPU implementations of route_topk, assign_locations and group_by_expert, and the routing of
// moe_layer's forward without autograd (tutel._C.route_without_grad).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "../../core/routing.h"
#include "../core_types.h"
#include "../group_by_expert_args.h"
#include "../op_args.h"
#include "routing_cpu.h"

namespace tutel {
namespace ops {
namespace {

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
  const RouteTopkArgs a = route_topk_args(scores_in, k);
  auto indices = at::empty({k, a.tokens}, a.scores.options().dtype(at::kInt));
  auto gates = at::empty({k, a.tokens}, a.scores.options());
  std::vector<int32_t> order;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scores.scalar_type(), "route_topk", [&] {
    core::select_topk(core_ptr<scalar_t>(a.scores), a.tokens, a.experts, k,
                      indices.data_ptr<int32_t>(), core_ptr<scalar_t>(gates));
  });
  // The top-1 score is each token's priority: gates row 0 holds it.
  if (batch_prioritized) compute_priority_order(gates[0], order);
  auto [locations, counts] =
      run_assign(indices, a.experts, batch_prioritized ? order.data() : nullptr, "route_topk");
  return {indices, gates, locations, counts};
}

std::tuple<at::Tensor, at::Tensor> assign_locations_cpu(const at::Tensor& indices_in,
                                                        int64_t experts,
                                                        const c10::optional<at::Tensor>& priority) {
  const AssignArgs a = assign_locations_args(indices_in, experts, priority);
  std::vector<int32_t> order;
  if (a.priority.defined()) compute_priority_order(a.priority, order);
  return run_assign(a.indices, experts, a.priority.defined() ? order.data() : nullptr,
                    "assign_locations");
}

}  // namespace

void group_by_expert_into(const at::Tensor& expert_ids, int64_t experts, int32_t* locations, int64_t* slot_choices,
                          int64_t* sorted_ids, int64_t* counts, int32_t* ends) {
  const int64_t tokens = expert_ids.size(0), k = expert_ids.size(1);
  // int32 and int64 ids are read as they are; narrower integers widened first.
  const at::ScalarType dtype = expert_ids.scalar_type();
  const at::Tensor ids = dtype == at::kInt || dtype == at::kLong ? expert_ids.contiguous()
                                                                  : expert_ids.to(at::kLong).contiguous();
  if (ids.scalar_type() == at::kInt) {
    core::group_choices_by_expert(ids.data_ptr<int32_t>(), tokens, k, experts, locations, slot_choices, sorted_ids,
                                  counts, ends);
  } else {
    core::group_choices_by_expert(ids.data_ptr<int64_t>(), tokens, k, experts, locations, slot_choices, sorted_ids,
                                  counts, ends);
  }
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_by_expert_cpu(
    const at::Tensor& expert_ids_in, int64_t experts) {
  const at::Tensor ids = checked_group_by_expert_ids(expert_ids_in, experts);
  const int64_t tokens = ids.size(0), k = ids.size(1);
  const auto options = ids.options();
  at::Tensor locations = at::empty({k, tokens}, options.dtype(at::kInt));
  at::Tensor slot_choices = at::empty({tokens * k}, options.dtype(at::kLong));
  at::Tensor sorted_ids = at::empty({tokens * k}, options.dtype(at::kLong));
  at::Tensor counts = at::empty({experts}, options.dtype(at::kLong));
  at::Tensor ends = at::empty({experts}, options.dtype(at::kInt));
  group_by_expert_into(ids, experts, locations.data_ptr<int32_t>(), slot_choices.data_ptr<int64_t>(),
                       sorted_ids.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), ends.data_ptr<int32_t>());
  return {locations, slot_choices, sorted_ids, counts, ends};
}

// The steps of moe_layer's default routing after the softmax (tutel.impls.fast_dispatch's
// extract_critical with the GShard loss, then the dropped choices' ids) in one pass over plain
// arrays, each rounded as the PyTorch operators it replaces round: sums and products in the
// operators' accumulation type (float for 16-bit scores), every tensor-valued step stored in the
// scores' dtype.  For the layer's forward without autograd (tutel.impls.inference_path): at
// decoding sizes the dozen operator calls cost ten times what they compute.
template <class S>
void route_without_grad_steps(const at::Tensor& indices, const at::Tensor& gates, const S* scores, int64_t tokens,
                              int64_t experts, int64_t k, bool normalize, int64_t capacity, bool batch_prioritized,
                              int32_t* ids, S* weights, int64_t* dispatch, S* loss) {
  using A = at::opmath_type<S>;
  const int32_t* index = indices.data_ptr<int32_t>();
  const S* gate = gates.data_ptr<S>();
  // Slots only where a choice can be dropped: an expert receives at most T choices.
  std::vector<int32_t> locations;
  if (capacity >= 0 && capacity < tokens) {
    std::vector<int32_t> order;
    if (batch_prioritized) compute_priority_order(gates[0], order);
    locations.resize(size_t(k * tokens));
    std::vector<int32_t> counts(size_t(k * experts));
    raise_if_failed(core::assign_locations(index, tokens, k, experts, batch_prioritized ? order.data() : nullptr,
                                           locations.data(), counts.data()),
                    "route_without_grad");
  }
  std::vector<int64_t> first(size_t(experts), 0);
  std::fill(dispatch, dispatch + experts, int64_t(0));
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t e = index[j * tokens + t];
      ++dispatch[e];
      if (j == 0) ++first[size_t(e)];
      const bool dropped = !locations.empty() && locations[size_t(j * tokens + t)] >= capacity;
      ids[t * k + j] = dropped ? int32_t(experts) : e;
    }
  }
  // normalize_gates: gates / clamp(gates.sum(0), eps).
  const A eps = A(std::numeric_limits<S>::epsilon());
  for (int64_t t = 0; t < tokens; ++t) {
    A sum = A(0);
    for (int64_t j = 0; j < k; ++j) sum += A(gate[j * tokens + t]);
    const A denominator = std::max(A(S(sum)), eps);
    for (int64_t j = 0; j < k; ++j) {
      const S g = gate[j * tokens + t];
      weights[t * k + j] = normalize && k > 1 ? S(A(g) / denominator) : g;
    }
  }
  // gshard_loss_from_counts: sum_e mean_t(scores[t, e]) * (first[e] / T), times E; 0 without tokens.
  if (tokens == 0) {
    *loss = S(0);
    return;
  }
  std::vector<A> column(size_t(experts), A(0));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < experts; ++e) column[size_t(e)] += A(scores[t * experts + e]);
  A total = A(0);
  for (int64_t e = 0; e < experts; ++e) {
    const S mean = S(column[size_t(e)] / A(tokens));
    const S share = S(A(S(first[size_t(e)])) / A(tokens));
    total += A(S(A(mean) * A(share)));
  }
  *loss = S(A(S(total)) * A(experts));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_without_grad_cpu(const at::Tensor& scores_in,
                                                                                   int64_t k, bool normalize,
                                                                                   int64_t capacity,
                                                                                   bool batch_prioritized) {
  const RouteTopkArgs a = route_topk_args(scores_in, k);
  TORCH_CHECK(a.scores.device().is_cpu(), "tutel._C.route_without_grad: `scores` must be on the CPU, got ",
              a.scores.device());
  const auto options = a.scores.options();
  at::Tensor indices = at::empty({k, a.tokens}, options.dtype(at::kInt));
  at::Tensor gates = at::empty({k, a.tokens}, options);
  at::Tensor ids = at::empty({a.tokens, k}, options.dtype(at::kInt));
  at::Tensor weights = at::empty({a.tokens, k}, options);
  at::Tensor dispatch = at::empty({a.experts}, options.dtype(at::kLong));
  at::Tensor loss = at::empty({}, options);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scores.scalar_type(), "route_without_grad", [&] {
    core::select_topk(core_ptr<scalar_t>(a.scores), a.tokens, a.experts, k, indices.data_ptr<int32_t>(),
                      core_ptr<scalar_t>(gates));
    route_without_grad_steps<scalar_t>(indices, gates, a.scores.data_ptr<scalar_t>(), a.tokens, a.experts, k,
                                       normalize, capacity, batch_prioritized, ids.data_ptr<int32_t>(),
                                       weights.data_ptr<scalar_t>(), dispatch.data_ptr<int64_t>(),
                                       loss.data_ptr<scalar_t>());
  });
  return {ids, weights, dispatch, loss};
}

}  // namespace

void register_routing_function(pybind11::module_& m) {
  m.def("route_without_grad", &route_without_grad_cpu,
        "moe_layer's default routing of softmax scores [T, E] without autograd, on the CPU: (expert ids [T, k] "
        "int32, the dropped choices' id E; their gate weights [T, k], normalized when `normalize` and k > 1; "
        "choices per expert [E] int64; the GShard loss) (tutel.impls.inference_path).  `capacity` < 0: nothing "
        "is dropped.",
        pybind11::arg("scores"), pybind11::arg("k"), pybind11::arg("normalize"), pybind11::arg("capacity"),
        pybind11::arg("batch_prioritized"));
}

TORCH_LIBRARY_IMPL(tutel, CPU, m) {
  m.impl("group_by_expert", &group_by_expert_cpu);
  m.impl("route_topk", &route_topk_cpu);
  m.impl("assign_locations", &assign_locations_cpu);
}

}  // namespace ops
}  // namespace tutel
