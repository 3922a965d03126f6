// kernels/slot_assignment.cu on the CPU, launched as assign_locations_cuda
// (csrc/ops/cuda/routing_cuda.cpp) launches it, against csrc/core's
// assign_locations: locations and counts bit for bit, and the same first bad
// entry reported.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <ostream>
#include <random>
#include <vector>

#include "core/routing.h"
#include "harness.h"
#include "../../../kernels/slot_assignment.cu"

namespace {

using namespace kernels_on_cpu;

struct Case {
  int64_t tokens, k, experts;
  bool ordered;     // a claiming order (as batch-prioritized routing gives)
  int64_t bad;      // entries with an expert index outside [0, experts)
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "T=" << c.tokens << " k=" << c.k << " E=" << c.experts << (c.ordered ? " ordered" : "")
       << " bad=" << c.bad;
}

struct Assignment {
  std::vector<int32_t> locations, counts;
};

// assign_locations_cuda with the emulated kernels: count, scan, hand out slots.
Assignment assign_on_cpu(const std::vector<int32_t>& indices, const int32_t* order, const Case& c,
                         ErrorChannel& errors, const LaunchOptions& options) {
  const auto plan = tutel::cuda::plan_slot_assignment(c.tokens, c.k, c.experts);
  std::vector<int32_t> table = garbage<int32_t>(plan.table_ints);
  Assignment a{garbage<int32_t>(c.k * c.tokens), garbage<int32_t>(c.k * c.experts)};
  TUTEL_EMULATED_LAUNCH(count_choices, plan.chunk_grid, options, indices.data(), order, c.tokens, c.k,
                        c.experts, plan.chunk_tokens, table.data(), errors.sink());
  TUTEL_EMULATED_LAUNCH(scan_choice_counts, plan.scan_grid, options, table.data(), plan.chunks, c.k,
                        c.experts, a.counts.data());
  TUTEL_EMULATED_LAUNCH(assign_slots, plan.assign_grid, options, indices.data(), order, c.tokens, c.k,
                        c.experts, plan.chunk_tokens, plan.chunks, table.data(), a.locations.data());
  return a;
}

class SlotAssignmentCu : public ::testing::TestWithParam<Case> {};

void check_assignment(const Assignment& got, const ErrorChannel& errors, const std::vector<int32_t>& indices,
                      const std::vector<bool>& is_bad, const int32_t* order_ptr, const Case& c);

TEST_P(SlotAssignmentCu, MatchesCoreBitForBit) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.tokens * 7 + c.k * 131 + c.experts * 17 + c.bad));
  std::uniform_int_distribution<int32_t> expert(0, int32_t(c.experts - 1));
  std::vector<int32_t> indices(static_cast<size_t>(c.k * c.tokens));
  for (auto& e : indices) e = expert(rng);
  // Bad entries: negative, or at or beyond `experts`.
  std::vector<bool> is_bad(indices.size(), false);
  for (int64_t b = 0; b < c.bad && !indices.empty(); ++b) {
    const size_t at = rng() % indices.size();
    indices[at] = (b % 2 == 0) ? int32_t(c.experts + b) : int32_t(-1 - b);
    is_bad[at] = true;
  }
  std::vector<int32_t> order(static_cast<size_t>(c.tokens));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int32_t* order_ptr = c.ordered && c.tokens > 0 ? order.data() : nullptr;

  for (const LaunchOptions& options : schedules_for_case(int(c.tokens + c.k + c.experts))) {
    SCOPED_TRACE(::testing::Message() << "schedule " << int(options.schedule));
    ErrorChannel errors;
    const Assignment got = assign_on_cpu(indices, order_ptr, c, errors, options);
    check_assignment(got, errors, indices, is_bad, order_ptr, c);
  }
}

void check_assignment(const Assignment& got, const ErrorChannel& errors, const std::vector<int32_t>& indices,
                      const std::vector<bool>& is_bad, const int32_t* order_ptr, const Case& c) {
  // The CPU operator on the same input reports the same first bad entry.
  std::vector<int32_t> want_locations(indices.size()), want_counts(static_cast<size_t>(c.k * c.experts));
  const auto status = tutel::core::assign_locations(indices.data(), c.tokens, c.k, c.experts, order_ptr,
                                                    want_locations.data(), want_counts.data());
  expect_same_error(errors, status, TUTEL_OP_ASSIGN_LOCATIONS);

  // The kernels treat a bad entry as claiming nothing: as the CPU operator
  // does with one more expert that takes every bad entry, whose slots and
  // count are left out.
  std::vector<int32_t> remapped = indices;
  for (size_t i = 0; i < remapped.size(); ++i)
    if (is_bad[i]) remapped[i] = int32_t(c.experts);
  std::vector<int32_t> counts_plus(static_cast<size_t>(c.k * (c.experts + 1)));
  ASSERT_TRUE(tutel::core::assign_locations(remapped.data(), c.tokens, c.k, c.experts + 1, order_ptr,
                                            want_locations.data(), counts_plus.data()).ok());
  for (int64_t j = 0; j < c.k; ++j)
    for (int64_t e = 0; e < c.experts; ++e) want_counts[j * c.experts + e] = counts_plus[j * (c.experts + 1) + e];
  for (size_t i = 0; i < remapped.size(); ++i)
    if (is_bad[i]) want_locations[i] = 0x7fffffff;  // larger than any capacity: dropped downstream
  EXPECT_TRUE(same_bits(got.locations, want_locations)) << "locations";
  EXPECT_TRUE(same_bits(got.counts, want_counts)) << "counts";
}

// Empty and tiny inputs; several chunks and assign blocks (64 tokens per chunk,
// 8 chunks per block); tables that fit the shared-memory cache (k * E <= 1024)
// and tables that do not.
INSTANTIATE_TEST_SUITE_P(
    Shapes, SlotAssignmentCu,
    ::testing::Values(Case{0, 2, 5, false, 0}, Case{1, 1, 1, false, 0}, Case{37, 2, 5, false, 0},
                      Case{37, 2, 5, true, 3}, Case{700, 2, 5, false, 0}, Case{700, 3, 7, true, 0},
                      Case{600, 1, 64, false, 5}, Case{130, 8, 200, true, 0}, Case{301, 4, 100, false, 2}),
    [](const auto& info) {
      const Case& c = info.param;
      return "T" + std::to_string(c.tokens) + "_k" + std::to_string(c.k) + "_E" + std::to_string(c.experts) +
             (c.ordered ? "_ordered" : "") + (c.bad ? "_bad" + std::to_string(c.bad) : "");
    });

}  // namespace
