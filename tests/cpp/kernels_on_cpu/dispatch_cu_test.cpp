// kernels/dispatch.cu on the CPU, launched as gather_slots_cuda and
// scatter_slots_cuda (csrc/ops/cuda/dispatch_cuda.cpp) launch it, against
// csrc/core's gather_slots / scatter_slots: moved and combined rows bit for
// bit, the same first bad entry reported, and the gate dot products within
// the accumulation type's rounding of a float64 (long double) result.
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <vector>

#include "core/dispatch.h"
#include "core/routing.h"
#include "core/scalar.h"
#include "harness.h"
#include "../../../kernels/dispatch.cu"
#include "variant_types.h"

namespace {

using namespace kernels_on_cpu;
namespace core = tutel::core;

long double value_of(storage_t v) {
  CoreT c;
  std::memcpy(&c, &v, sizeof(c));
  return core::Scalar<CoreT>::load(c);
}

// The SM count the plan spreads shared-slot sums over (several blocks here).
constexpr int kMultiprocessors = 3;

struct Case {
  int64_t tokens, experts, k, capacity, model_dim;
  bool shared = false;  // caller-made locations: slots claimed by several entries
  int bad = 0;          // entries with a bad expert index or a negative location
  int shift = 0;        // row tensors one element off 16-byte alignment
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "T=" << c.tokens << " E=" << c.experts << " k=" << c.k << " C=" << c.capacity << " M=" << c.model_dim;
}

struct Problem {
  std::vector<int32_t> indices, locations;
  std::vector<bool> bad;
  std::vector<acc_t> weights;
};

Problem make_problem(const Case& c, std::mt19937& rng) {
  Problem p;
  const size_t entries = static_cast<size_t>(c.k * c.tokens);
  std::uniform_int_distribution<int32_t> expert(0, int32_t(c.experts - 1));
  p.indices.resize(entries);
  for (auto& e : p.indices) e = expert(rng);
  p.locations.resize(entries);
  if (c.shared) {
    std::uniform_int_distribution<int32_t> location(0, int32_t(c.capacity));  // capacity itself: dropped
    for (auto& l : p.locations) l = location(rng);
  } else {
    std::vector<int32_t> counts(static_cast<size_t>(c.k * c.experts));
    EXPECT_TRUE(core::assign_locations(p.indices.data(), c.tokens, c.k, c.experts, nullptr, p.locations.data(),
                                       counts.data()).ok());
  }
  p.bad.assign(entries, false);
  for (int b = 0; b < c.bad && entries > 0; ++b) {
    const size_t at = rng() % entries;
    if (b % 3 == 0) p.indices[at] = int32_t(c.experts + b);
    if (b % 3 == 1) p.indices[at] = -1;
    if (b % 3 == 2) p.locations[at] = -2 - b;
    p.bad[at] = true;
  }
  std::uniform_real_distribution<double> weight(-0.5, 1.5);
  p.weights.resize(entries);
  for (auto& w : p.weights) w = acc_t(weight(rng));
  return p;
}

std::vector<storage_t> random_rows(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  std::vector<storage_t> v(static_cast<size_t>(n > 0 ? n : 0));
  for (auto& x : v) x = storage_of(dist(rng));
  return v;
}

// csrc/core takes row pointers even when rows are empty (model_dim 0) and
// hands them to memcpy, which must not see a null pointer: empty vectors get
// one unused element for the core's calls.
template <class T>
std::vector<T> for_core(std::vector<T> v) {
  if (v.empty()) v.resize(1);
  return v;
}

// Bad entries as the kernels treat them: dropped (location == capacity).
Problem with_bad_entries_dropped(const Problem& p, const Case& c) {
  Problem q = p;
  for (size_t i = 0; i < q.bad.size(); ++i)
    if (q.bad[i]) {
      q.indices[i] = 0;
      q.locations[i] = int32_t(c.capacity);
    }
  return q;
}

core::SlotTable table_of(const Problem& p, const Case& c) {
  return core::SlotTable{p.indices.data(), p.locations.data(), c.k, c.tokens, c.experts, c.capacity};
}

// The slot row of entry `at`, or -1 when dropped or bad.
int64_t slot_of_entry(const Problem& p, const Case& c, int64_t at) {
  const int32_t e = p.indices[at], l = p.locations[at];
  if (e < 0 || e >= c.experts || l < 0 || l >= c.capacity) return -1;
  return int64_t(e) * c.capacity + l;
}

// dots[at] against <a row, b row> in long double; exactly +0 for a dropped or bad entry.
void check_dots(const std::vector<acc_t>& dots, const Problem& p, const Case& c, const std::vector<storage_t>& slot_rows,
                const std::vector<storage_t>& token_rows) {
  for (int64_t at = 0; at < c.k * c.tokens; ++at) {
    const int64_t slot = slot_of_entry(p, c, at);
    if (slot < 0) {
      EXPECT_TRUE(dots[at] == 0 && !std::signbit(dots[at])) << "dropped entry " << at << ": " << dots[at];
      continue;
    }
    long double exact = 0, magnitude = 0;
    for (int64_t m = 0; m < c.model_dim; ++m) {
      const long double term = value_of(slot_rows[slot * c.model_dim + m]) *
                               value_of(token_rows[(at % c.tokens) * c.model_dim + m]);
      exact += term;
      magnitude += std::fabs(term);
    }
    EXPECT_TRUE(dot_close<acc_t>(dots[at], exact, magnitude, c.model_dim)) << "entry " << at;
  }
}

class DispatchCu : public ::testing::TestWithParam<Case> {};

// gather_slots_cuda: rows [E * C, M] -> out [T, M], dots [k, T].
TEST_P(DispatchCu, GatherMatchesCore) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.tokens * 5 + c.experts * 3 + c.k + c.capacity * 11 + c.model_dim * 7 + c.bad));
  const Problem p = make_problem(c, rng);
  const std::vector<storage_t> rows = random_rows(c.experts * c.capacity * c.model_dim, rng);
  const std::vector<storage_t> other = random_rows(c.tokens * c.model_dim, rng);
  int variation = 0;
  for (bool weighted : {false, true})
    for (bool with_dots : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "weighted=" << weighted << " dots=" << with_dots);
      const DeviceBuffer<storage_t> d_rows(rows, c.shift), d_other(other, c.shift);
      const DeviceBuffer<storage_t> d_out(c.tokens * c.model_dim, c.shift);
      const DeviceBuffer<acc_t> d_dots(with_dots ? c.k * c.tokens : 0);
      const DeviceBuffer<int32_t> d_indices(p.indices), d_locations(p.locations);
      const DeviceBuffer<acc_t> d_weights(weighted ? p.weights : std::vector<acc_t>());
      const storage_t* other_ptr = with_dots ? d_other.data() : nullptr;
      ErrorChannel errors;
      const auto plan = tutel::cuda::plan_gather(c.tokens, c.model_dim, sizeof(storage_t),
                                                 {d_rows.data(), other_ptr, d_out.data()});
      const LaunchOptions options = schedule_for_case(int(c.tokens + c.model_dim) + variation++);
      if (plan.layout.vector)
        TUTEL_EMULATED_LAUNCH(gather_slots_vector, plan.grid, options, d_rows.data(), d_indices.data(),
                              d_locations.data(), d_weights.data(), other_ptr, d_dots.data(), d_out.data(),
                              c.tokens, c.k, c.experts, c.capacity, c.model_dim, plan.layout.group_log2,
                              errors.sink());
      else
        TUTEL_EMULATED_LAUNCH(gather_slots_scalar, plan.grid, options, d_rows.data(), d_indices.data(),
                              d_locations.data(), d_weights.data(), other_ptr, d_dots.data(), d_out.data(),
                              c.tokens, c.k, c.experts, c.capacity, c.model_dim, plan.layout.group_log2,
                              errors.sink());
      EXPECT_EQ(plan.layout.vector, c.shift == 0 && c.model_dim % (16 / int64_t(sizeof(storage_t))) == 0);

      std::vector<storage_t> want = for_core(std::vector<storage_t>(static_cast<size_t>(c.tokens * c.model_dim)));
      std::vector<acc_t> want_dots = for_core(std::vector<acc_t>(static_cast<size_t>(c.k * c.tokens)));
      const auto status = core::gather_slots<CoreT>(
          reinterpret_cast<const CoreT*>(for_core(rows).data()), c.model_dim, table_of(p, c),
          weighted ? p.weights.data() : nullptr, reinterpret_cast<const CoreT*>(for_core(other).data()),
          want_dots.data(), reinterpret_cast<CoreT*>(want.data()));
      want.resize(static_cast<size_t>(c.tokens * c.model_dim));
      expect_same_error(errors, status, TUTEL_OP_GATHER_SLOTS);
      EXPECT_TRUE(same_bits(d_out.values(), want)) << "out";
      if (with_dots) check_dots(d_dots.values(), p, c, rows, other);
    }
}

// scatter_slots_cuda: src [T, M] -> out [E * C, M], dots [k, T].
TEST_P(DispatchCu, ScatterMatchesCore) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.tokens * 3 + c.experts * 5 + c.k * 7 + c.capacity + c.model_dim * 13 + c.bad));
  const Problem p = make_problem(c, rng);
  const std::vector<storage_t> src = random_rows(c.tokens * c.model_dim, rng);
  const std::vector<storage_t> other = random_rows(c.experts * c.capacity * c.model_dim, rng);
  int variation = 0;
  for (bool weighted : {false, true})
    for (bool with_dots : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "weighted=" << weighted << " dots=" << with_dots);
      const int64_t slots = c.experts * c.capacity;
      const DeviceBuffer<storage_t> d_src(src, c.shift), d_other(other, c.shift);
      const DeviceBuffer<storage_t> d_out(slots * c.model_dim, c.shift);
      const DeviceBuffer<acc_t> d_dots(with_dots ? c.k * c.tokens : 0);
      const DeviceBuffer<int32_t> d_indices(p.indices), d_locations(p.locations);
      const DeviceBuffer<acc_t> d_weights(weighted ? p.weights : std::vector<acc_t>());
      const storage_t* other_ptr = with_dots ? d_other.data() : nullptr;
      ErrorChannel errors;
      const auto plan = tutel::cuda::plan_scatter(c.tokens, c.k, c.experts, c.capacity, c.model_dim,
                                                  sizeof(storage_t), kMultiprocessors,
                                                  {d_src.data(), other_ptr, d_out.data()});
      const DeviceBuffer<int32_t> slot_table(std::vector<int32_t>(static_cast<size_t>(plan.slot_table_ints), 0));
      const LaunchOptions options = schedule_for_case(int(c.tokens + c.model_dim) + variation++);
      TUTEL_EMULATED_LAUNCH(scatter_claim_slots, plan.claim_grid, options, d_indices.data(), d_locations.data(),
                            c.tokens, c.k, c.experts, c.capacity, slot_table.data(), d_dots.data(), errors.sink());
      if (plan.layout.vector)
        TUTEL_EMULATED_LAUNCH(scatter_slots_vector, plan.row_grid, options, d_src.data(), d_indices.data(),
                              d_locations.data(), d_weights.data(), other_ptr, d_dots.data(), d_out.data(),
                              c.tokens, c.k, c.experts, c.capacity, c.model_dim, plan.layout.group_log2,
                              slot_table.data(), plan.shared_blocks);
      else
        TUTEL_EMULATED_LAUNCH(scatter_slots_scalar, plan.row_grid, options, d_src.data(), d_indices.data(),
                              d_locations.data(), d_weights.data(), other_ptr, d_dots.data(), d_out.data(),
                              c.tokens, c.k, c.experts, c.capacity, c.model_dim, plan.layout.group_log2,
                              slot_table.data(), plan.shared_blocks);

      // The CPU operator reports the same first bad entry; it writes nothing
      // then, so the rows are compared with its result once they are dropped.
      std::vector<storage_t> want = for_core(std::vector<storage_t>(static_cast<size_t>(slots * c.model_dim)));
      std::vector<acc_t> want_dots = for_core(std::vector<acc_t>(static_cast<size_t>(c.k * c.tokens)));
      const std::vector<storage_t> core_src = for_core(src), core_other = for_core(other);
      const auto status = core::scatter_slots<CoreT>(
          reinterpret_cast<const CoreT*>(core_src.data()), c.model_dim, table_of(p, c), nullptr, nullptr, nullptr,
          reinterpret_cast<CoreT*>(want.data()));
      expect_same_error(errors, status, TUTEL_OP_SCATTER_SLOTS);
      const Problem dropped = with_bad_entries_dropped(p, c);
      ASSERT_TRUE(core::scatter_slots<CoreT>(reinterpret_cast<const CoreT*>(core_src.data()), c.model_dim,
                                             table_of(dropped, c), weighted ? p.weights.data() : nullptr,
                                             reinterpret_cast<const CoreT*>(core_other.data()), want_dots.data(),
                                             reinterpret_cast<CoreT*>(want.data())).ok());
      want.resize(static_cast<size_t>(slots * c.model_dim));
      EXPECT_TRUE(same_bits(d_out.values(), want)) << "out";
      if (with_dots) check_dots(d_dots.values(), p, c, other, src);
    }
}

Case shared(Case c) { c.shared = true; return c; }
Case bad(Case c, int n) { c.bad = n; return c; }
Case misaligned(Case c) { c.shift = 1; return c; }

// Empty inputs, model_dim 0, capacity 0, odd sizes (scalar kernels), rows of
// whole 16-byte vectors (vector kernels) and the same misaligned, rows longer
// than one strip of a warp, many dropped choices, slots claimed several times
// (summed by several blocks), bad entries, and several blocks per launch.
INSTANTIATE_TEST_SUITE_P(
    Shapes, DispatchCu,
    ::testing::Values(Case{0, 3, 1, 4, 5}, Case{5, 2, 2, 3, 0}, Case{37, 5, 2, 0, 8}, Case{1, 1, 1, 1, 1},
                      Case{150, 5, 2, 70, 7}, Case{150, 4, 3, 120, 32}, misaligned(Case{150, 4, 3, 120, 32}),
                      Case{40, 3, 2, 30, 1000}, Case{200, 8, 2, 10, 16}, shared(Case{130, 8, 2, 40, 9}),
                      bad(Case{37, 5, 2, 9, 7}, 4), bad(shared(Case{60, 3, 3, 20, 32}), 3)),
    [](const auto& info) {
      const Case& c = info.param;
      return "T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_k" + std::to_string(c.k) +
             "_C" + std::to_string(c.capacity) + "_M" + std::to_string(c.model_dim) + (c.shared ? "_shared" : "") +
             (c.bad ? "_bad" + std::to_string(c.bad) : "") + (c.shift ? "_misaligned" : "");
    });

}  // namespace
