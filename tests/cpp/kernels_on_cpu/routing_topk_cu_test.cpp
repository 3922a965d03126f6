// kernels/routing_topk.cu on the CPU, launched as route_topk_cuda
// (csrc/ops/cuda/routing_cuda.cpp) launches it together with
// kernels/slot_assignment.cu, against csrc/core's select_topk, priority_order
// and assign_locations: indices, gates, claiming order, locations and counts
// bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <vector>

#include "core/routing.h"
#include "core/scalar.h"
#include "harness.h"
#include "../../../kernels/routing_topk.cu"
#include "../../../kernels/slot_assignment.cu"
#include "variant_types.h"

namespace {

using namespace kernels_on_cpu;
namespace core = tutel::core;

template <class T>
const CoreT* as_core(const std::vector<T>& v) { return reinterpret_cast<const CoreT*>(v.data()); }

struct Case {
  int64_t tokens, experts, k;
};

void PrintTo(const Case& c, std::ostream* out) { *out << "T=" << c.tokens << " E=" << c.experts << " k=" << c.k; }

// Scores with many ties (multiples of 1/4 in [-2, 2]), and NaN, +-0 and +-inf
// sprinkled in: every rule of the ranking is exercised.
std::vector<storage_t> random_scores(const Case& c, std::mt19937& rng) {
  return tied_values(static_cast<size_t>(c.tokens * c.experts), 8, 40, rng);
}

struct Routing {
  std::vector<int32_t> indices, locations, counts;
  std::vector<storage_t> gates;
  std::vector<int32_t> order;  // batch-prioritized only
};

// priority_order() of routing_cuda.cpp: sort keys, then a stable ascending sort
// of them (at::sort there, std::stable_sort here).
std::vector<int32_t> priority_order_on_cpu(const storage_t* priority, int64_t tokens,
                                           const LaunchOptions& options) {
  std::vector<sort_key_t> keys = garbage<sort_key_t>(tokens);
  TUTEL_EMULATED_LAUNCH(priority_sort_keys, tutel::cuda::plan_priority_keys(tokens), options, priority,
                        tokens, keys.data());
  std::vector<int32_t> order(static_cast<size_t>(tokens));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return keys[a] < keys[b]; });
  return order;
}

// route_topk_cuda with the emulated kernels.
Routing route_on_cpu(const std::vector<storage_t>& scores, const Case& c, bool batch_prioritized,
                     const LaunchOptions& options) {
  const auto plan = tutel::cuda::plan_slot_assignment(c.tokens, c.k, c.experts);
  Routing r{garbage<int32_t>(c.k * c.tokens), garbage<int32_t>(c.k * c.tokens), garbage<int32_t>(c.k * c.experts),
            garbage<storage_t>(c.k * c.tokens), {}};
  std::vector<int32_t> table = garbage<int32_t>(plan.table_ints);
  int* fused_counts = batch_prioritized || table.empty() ? nullptr : table.data();
  TUTEL_EMULATED_LAUNCH(route_topk, plan.chunk_grid, options, scores.data(), c.tokens, c.experts, c.k,
                        plan.chunk_tokens, r.indices.data(), r.gates.data(), fused_counts);
  const int* order = nullptr;
  if (batch_prioritized && c.tokens > 0) {
    r.order = priority_order_on_cpu(r.gates.data(), c.tokens, options);  // top-1 scores
    order = r.order.data();
    const TutelErrorSink no_reports{nullptr, nullptr, 0};
    TUTEL_EMULATED_LAUNCH(count_choices, plan.chunk_grid, options, r.indices.data(), order, c.tokens, c.k,
                          c.experts, plan.chunk_tokens, table.data(), no_reports);
  }
  TUTEL_EMULATED_LAUNCH(scan_choice_counts, plan.scan_grid, options, table.data(), plan.chunks, c.k,
                        c.experts, r.counts.data());
  TUTEL_EMULATED_LAUNCH(assign_slots, plan.assign_grid, options, r.indices.data(), order, c.tokens, c.k,
                        c.experts, plan.chunk_tokens, plan.chunks, table.data(), r.locations.data());
  return r;
}

class RoutingTopkCu : public ::testing::TestWithParam<Case> {};

void check_routing(const Case& c, bool batch_prioritized, const std::vector<storage_t>& scores, const Routing& got);

void check_routing(const Case& c, bool batch_prioritized) {
  std::mt19937 rng(unsigned(c.tokens * 3 + c.experts * 71 + c.k + batch_prioritized));
  const std::vector<storage_t> scores = random_scores(c, rng);
  for (const LaunchOptions& options : schedules_for_case(int(c.tokens + c.experts + c.k + batch_prioritized))) {
    SCOPED_TRACE(::testing::Message() << "schedule " << int(options.schedule));
    check_routing(c, batch_prioritized, scores, route_on_cpu(scores, c, batch_prioritized, options));
  }
}

void check_routing(const Case& c, bool batch_prioritized, const std::vector<storage_t>& scores, const Routing& got) {

  std::vector<int32_t> indices(static_cast<size_t>(c.k * c.tokens)), locations(indices.size()),
      counts(static_cast<size_t>(c.k * c.experts));
  std::vector<storage_t> gates(indices.size());
  core::select_topk(as_core(scores), c.tokens, c.experts, c.k, indices.data(),
                    reinterpret_cast<CoreT*>(gates.data()));
  std::vector<int32_t> order;
  if (batch_prioritized && c.tokens > 0) {
    order.resize(static_cast<size_t>(c.tokens));
    core::priority_order(as_core(gates), c.tokens, order.data());
    EXPECT_TRUE(same_bits(got.order, order)) << "claiming order";
  }
  ASSERT_TRUE(core::assign_locations(indices.data(), c.tokens, c.k, c.experts, order.empty() ? nullptr : order.data(),
                                     locations.data(), counts.data()).ok());
  EXPECT_TRUE(same_bits(got.indices, indices)) << "indices";
  EXPECT_TRUE(same_bits(got.gates, gates)) << "gates";
  EXPECT_TRUE(same_bits(got.locations, locations)) << "locations";
  EXPECT_TRUE(same_bits(got.counts, counts)) << "counts";
}

TEST_P(RoutingTopkCu, RouteMatchesCoreBitForBit) { check_routing(GetParam(), false); }

TEST_P(RoutingTopkCu, BatchPrioritizedRouteMatchesCoreBitForBit) { check_routing(GetParam(), true); }

// Empty and tiny inputs, k up to 8, several chunks (64 tokens, or 128 when
// k * E > 256) and assign blocks, more experts than a block has threads.
INSTANTIATE_TEST_SUITE_P(Shapes, RoutingTopkCu,
                         ::testing::Values(Case{0, 4, 1}, Case{1, 1, 1}, Case{37, 5, 2}, Case{130, 64, 8},
                                           Case{530, 3, 3}, Case{65, 300, 1}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return "T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_k" +
                                  std::to_string(c.k);
                         });

}  // namespace
