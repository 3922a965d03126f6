// kernels/dispatch.cu on the CPU, launched as gather_slots_cuda and
// scatter_slots_cuda (csrc/ops/cuda/dispatch_cuda.cpp) launch it, against
// csrc/core's gather_slots / scatter_slots: moved and combined rows bit for
// bit, the same first bad entry reported, and the gate dot products within
// the accumulation type's rounding of a float64 (long double) result.  Both
// layouts: an expert table (indices) and the grouped one (no indices: expert
// 0, distinct locations for the scatter), with weights of every floating
// dtype read in place through strides.
#include <algorithm>
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

// How the weights are stored: their dtype (TUTEL_WEIGHTS_*) and layout.
enum class Layout {
  kChoiceMajor,  // [k, T] contiguous
  kTokenMajor,   // [T, k] contiguous, read as [k, T] through .t()
  kPadded,       // [k, T] with rows 3 elements apart beyond T
};

struct Case {
  int64_t tokens, experts, k, capacity, model_dim;
  bool shared = false;   // caller-made locations: slots claimed by several entries
  int bad = 0;           // entries with a bad expert index or a negative location
  int shift = 0;         // row tensors one element off 16-byte alignment
  bool grouped = false;  // no indices (expert 0); distinct locations unless `shared`
  int weights_dtype = -1;  // TUTEL_WEIGHTS_*, or -1 for the accumulation type's
  Layout layout = Layout::kChoiceMajor;
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "T=" << c.tokens << " E=" << c.experts << " k=" << c.k << " C=" << c.capacity << " M=" << c.model_dim;
}

struct Problem {
  std::vector<int32_t> indices, locations;  // indices empty: grouped
  std::vector<bool> bad;
  std::vector<double> weights;  // [k, T] values, before their storage dtype rounds them
};

// Grouped locations: the kept entries get distinct random slots (some slots stay
// unclaimed when there are more slots than entries), the rest are dropped at
// capacity or beyond, as tutel.experts.routed places them.
std::vector<int32_t> grouped_locations(const Case& c, std::mt19937& rng) {
  const size_t entries = static_cast<size_t>(c.k * c.tokens);
  std::vector<int32_t> free_slots(static_cast<size_t>(c.capacity));
  for (size_t l = 0; l < free_slots.size(); ++l) free_slots[l] = int32_t(l);
  std::shuffle(free_slots.begin(), free_slots.end(), rng);
  std::vector<int32_t> locations(entries);
  size_t used = 0;
  for (auto& l : locations) {
    const bool drop = rng() % 7 == 0 || used == free_slots.size();
    l = drop ? int32_t(c.capacity + rng() % 3) : free_slots[used++];
  }
  return locations;
}

Problem make_problem(const Case& c, std::mt19937& rng) {
  Problem p;
  const size_t entries = static_cast<size_t>(c.k * c.tokens);
  std::uniform_int_distribution<int32_t> expert(0, int32_t(c.experts - 1));
  p.indices.resize(c.grouped ? 0 : entries);
  for (auto& e : p.indices) e = expert(rng);
  p.locations.resize(entries);
  if (c.grouped && !c.shared) {
    p.locations = grouped_locations(c, rng);
  } else if (c.shared) {
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
    if (b % 3 == 0 && !c.grouped) p.indices[at] = int32_t(c.experts + b);
    if (b % 3 == 1 && !c.grouped) p.indices[at] = -1;
    if (b % 3 == 2 || c.grouped) p.locations[at] = -2 - b;
    p.bad[at] = true;
  }
  std::uniform_real_distribution<double> weight(-0.5, 1.5);
  p.weights.resize(entries);
  for (auto& w : p.weights) w = weight(rng);  // not representable in 16 bits: conversions matter
  return p;
}

// The weights stored as the case says: `storage` holds their bytes (8-byte
// aligned), `view` describes them, and `rounded` is each weight as the kernels
// must see it ([k, T] in the accumulation type, converted as the CPU converts).
struct StoredWeights {
  std::vector<double> storage;
  core::ChoiceWeights view;
  std::vector<acc_t> rounded;
};

StoredWeights store_weights(const Problem& p, const Case& c) {
  const int dtype = c.weights_dtype >= 0 ? c.weights_dtype
                                          : (sizeof(acc_t) == 8 ? TUTEL_WEIGHTS_FLOAT64 : TUTEL_WEIGHTS_FLOAT32);
  const int64_t size = dtype == TUTEL_WEIGHTS_FLOAT64 ? 8 : (dtype == TUTEL_WEIGHTS_FLOAT32 ? 4 : 2);
  int64_t choice_stride = c.tokens, token_stride = 1, elements = c.k * c.tokens;
  if (c.layout == Layout::kTokenMajor) choice_stride = 1, token_stride = c.k;
  if (c.layout == Layout::kPadded) choice_stride = c.tokens + 3, elements = c.k * (c.tokens + 3);
  StoredWeights w;
  w.storage.assign(static_cast<size_t>((elements * size + 7) / 8), std::nan(""));
  auto* bytes = reinterpret_cast<unsigned char*>(w.storage.data());
  w.rounded.resize(p.weights.size());
  for (int64_t j = 0; j < c.k; ++j)
    for (int64_t t = 0; t < c.tokens; ++t) {
      const double v = p.weights[j * c.tokens + t];
      unsigned char* at = bytes + (j * choice_stride + t * token_stride) * size;
      long double exact = v;  // the stored value
      if (dtype == TUTEL_WEIGHTS_FLOAT64) std::memcpy(at, &v, 8);
      if (dtype == TUTEL_WEIGHTS_FLOAT32) { const float f = float(v); std::memcpy(at, &f, 4); exact = f; }
      if (dtype == TUTEL_WEIGHTS_BFLOAT16) {
        const core::bfloat16 b = core::float_to_bf16(float(v));
        std::memcpy(at, &b, 2);
        exact = core::bf16_to_float(b);
      }
      if (dtype == TUTEL_WEIGHTS_FLOAT16) {
        const core::float16 h = core::float_to_fp16(float(v));
        std::memcpy(at, &h, 2);
        exact = core::fp16_to_float(h);
      }
      w.rounded[j * c.tokens + t] = acc_t(double(exact));  // rounds only float64 into float32
    }
  w.view = core::ChoiceWeights{w.storage.data(), core::WeightType(dtype), choice_stride, token_stride};
  return w;
}

// The kernels' view of weights kept at `device` (a copy of stored.storage).
TutelChoiceWeights kernel_weights(const StoredWeights& stored, const double* device) {
  return TutelChoiceWeights{device, stored.view.choice_stride, stored.view.token_stride, int(stored.view.type)};
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
      if (!c.grouped) q.indices[i] = 0;
      q.locations[i] = int32_t(c.capacity);
    }
  return q;
}

core::SlotTable table_of(const Problem& p, const Case& c) {
  return core::SlotTable{c.grouped ? nullptr : p.indices.data(), p.locations.data(), c.k, c.tokens, c.experts,
                         c.capacity};
}

// The slot row of entry `at`, or -1 when dropped or bad.
int64_t slot_of_entry(const Problem& p, const Case& c, int64_t at) {
  const int32_t e = c.grouped ? 0 : p.indices[at], l = p.locations[at];
  if (e < 0 || e >= c.experts || l < 0 || l >= c.capacity) return -1;
  return int64_t(e) * c.capacity + l;
}

// dots[at] against <a row, b row> in long double; exactly +0 for a dropped or bad entry.
// Entries marked in `skip` are not checked.
void check_dots(const std::vector<acc_t>& dots, const Problem& p, const Case& c, const std::vector<storage_t>& slot_rows,
                const std::vector<storage_t>& token_rows, const std::vector<bool>& skip = {}) {
  for (int64_t at = 0; at < c.k * c.tokens; ++at) {
    if (!skip.empty() && skip[at]) continue;
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

// The core with the stored weights read in place gives what it gives with the
// same weights converted beforehand into a contiguous [k, T] table: the strided,
// any-dtype reading the kernels are compared against is itself right.
template <class Run>
void expect_same_as_converted(const StoredWeights& w, const Case& c, Run run) {
  const auto in_place = run(w.view);
  const auto converted = run(core::contiguous_weights(for_core(w.rounded).data(), c.tokens));
  EXPECT_TRUE(same_bits(in_place.first, converted.first)) << "core rows, weights in place vs converted";
  EXPECT_TRUE(same_bits(in_place.second, converted.second)) << "core dots, weights in place vs converted";
}

// gather_slots_cuda: rows [E * C, M] -> out [T, M], dots [k, T].
TEST_P(DispatchCu, GatherMatchesCore) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.tokens * 5 + c.experts * 3 + c.k + c.capacity * 11 + c.model_dim * 7 + c.bad));
  const Problem p = make_problem(c, rng);
  const StoredWeights w = store_weights(p, c);
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
      const DeviceBuffer<double> d_weights(weighted ? w.storage : std::vector<double>());
      const TutelChoiceWeights weights = kernel_weights(w, d_weights.data());
      const storage_t* other_ptr = with_dots ? d_other.data() : nullptr;
      ErrorChannel errors;
      const auto plan = tutel::cuda::plan_gather(c.tokens, c.model_dim, sizeof(storage_t),
                                                 {d_rows.data(), other_ptr, d_out.data()});
      const LaunchOptions options = schedule_for_case(int(c.tokens + c.model_dim) + variation++);
      if (plan.layout.vector)
        TUTEL_EMULATED_LAUNCH(gather_slots_vector, plan.grid, options, d_rows.data(), d_indices.data(),
                              d_locations.data(), weights, other_ptr, d_dots.data(), d_out.data(), c.tokens, c.k,
                              c.experts, c.capacity, c.model_dim, plan.layout.group_log2, errors.sink());
      else
        TUTEL_EMULATED_LAUNCH(gather_slots_scalar, plan.grid, options, d_rows.data(), d_indices.data(),
                              d_locations.data(), weights, other_ptr, d_dots.data(), d_out.data(), c.tokens, c.k,
                              c.experts, c.capacity, c.model_dim, plan.layout.group_log2, errors.sink());
      EXPECT_EQ(plan.layout.vector, c.shift == 0 && c.model_dim % (16 / int64_t(sizeof(storage_t))) == 0);

      core::Status status;
      const auto core_gather = [&](const core::ChoiceWeights& view) {
        std::vector<storage_t> want = for_core(std::vector<storage_t>(static_cast<size_t>(c.tokens * c.model_dim)));
        std::vector<acc_t> want_dots = for_core(std::vector<acc_t>(static_cast<size_t>(c.k * c.tokens)));
        status = core::gather_slots<CoreT>(reinterpret_cast<const CoreT*>(for_core(rows).data()), c.model_dim,
                                           table_of(p, c), weighted ? view : core::ChoiceWeights{},
                                           reinterpret_cast<const CoreT*>(for_core(other).data()), want_dots.data(),
                                           reinterpret_cast<CoreT*>(want.data()));
        want.resize(static_cast<size_t>(c.tokens * c.model_dim));
        return std::make_pair(want, want_dots);
      };
      if (weighted && c.bad == 0) expect_same_as_converted(w, c, core_gather);
      const std::vector<storage_t> want = core_gather(w.view).first;
      expect_same_error(errors, status, TUTEL_OP_GATHER_SLOTS);
      EXPECT_TRUE(same_bits(d_out.values(), want)) << "out";
      if (with_dots) check_dots(d_dots.values(), p, c, rows, other);
    }
}

// The scatter's launches as scatter_slots_cuda makes them: the claims and the
// rows, on a zeroed slot table with indices, and grouped on one that starts as
// garbage (entry numbers included, which the rows kernel must not trust
// unless they point back).
void launch_scatter(const Case& c, const LaunchOptions& options, const tutel::cuda::ScatterPlan& plan,
                    const storage_t* src, const int32_t* indices, const int32_t* locations,
                    const TutelChoiceWeights& weights, const storage_t* other, acc_t* dots, storage_t* out,
                    TutelErrorSink errors, std::mt19937& rng) {
  std::vector<int32_t> table(static_cast<size_t>(plan.slot_table_ints), 0);
  if (c.grouped)
    for (auto& v : table) v = int32_t(rng() % (c.k * c.tokens + 4)) - 2;
  const DeviceBuffer<int32_t> slot_table(table);
  if (c.grouped) indices = nullptr;
  TUTEL_EMULATED_LAUNCH(scatter_claim_slots, plan.claim_grid, options, indices, locations, c.tokens, c.k, c.experts,
                        c.capacity, slot_table.data(), dots, errors);
  if (plan.layout.vector)
    TUTEL_EMULATED_LAUNCH(scatter_slots_vector, plan.row_grid, options, src, indices, locations, weights, other,
                          dots, out, c.tokens, c.k, c.experts, c.capacity, c.model_dim, plan.layout.group_log2,
                          slot_table.data(), plan.shared_blocks);
  else
    TUTEL_EMULATED_LAUNCH(scatter_slots_scalar, plan.row_grid, options, src, indices, locations, weights, other,
                          dots, out, c.tokens, c.k, c.experts, c.capacity, c.model_dim, plan.layout.group_log2,
                          slot_table.data(), plan.shared_blocks);
}

// A grouped scatter whose locations break its promise (a slot named by several
// kept entries) writes one of them, which one is unspecified.  Returns, per
// entry, whether its slot is such a slot, and makes `got` agree with `want` on
// those slots' rows: only the rest is compared.
std::vector<bool> forget_shared_slots(const Problem& p, const Case& c, std::vector<storage_t>& got,
                                      const std::vector<storage_t>& want) {
  std::vector<int> claims(static_cast<size_t>(c.experts * c.capacity), 0);
  for (int64_t at = 0; at < c.k * c.tokens; ++at)
    if (slot_of_entry(p, c, at) >= 0) ++claims[slot_of_entry(p, c, at)];
  std::vector<bool> in_shared(static_cast<size_t>(c.k * c.tokens), false);
  for (int64_t at = 0; at < c.k * c.tokens; ++at) {
    const int64_t slot = slot_of_entry(p, c, at);
    if (slot < 0 || claims[slot] < 2) continue;
    in_shared[at] = true;
    std::copy_n(want.begin() + slot * c.model_dim, c.model_dim, got.begin() + slot * c.model_dim);
  }
  return in_shared;
}

// scatter_slots_cuda: src [T, M] -> out [E * C, M], dots [k, T].
TEST_P(DispatchCu, ScatterMatchesCore) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.tokens * 3 + c.experts * 5 + c.k * 7 + c.capacity + c.model_dim * 13 + c.bad));
  const Problem p = make_problem(c, rng);
  const StoredWeights w = store_weights(p, c);
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
      const DeviceBuffer<double> d_weights(weighted ? w.storage : std::vector<double>());
      const storage_t* other_ptr = with_dots ? d_other.data() : nullptr;
      ErrorChannel errors;
      const auto plan = tutel::cuda::plan_scatter(c.tokens, c.k, c.experts, c.capacity, c.model_dim,
                                                  sizeof(storage_t), kMultiprocessors,
                                                  {d_src.data(), other_ptr, d_out.data()}, c.grouped);
      EXPECT_EQ(plan.slot_table_ints, c.grouped ? c.capacity : 2 * slots + 1);
      launch_scatter(c, schedule_for_case(int(c.tokens + c.model_dim) + variation++), plan, d_src.data(),
                     d_indices.data(), d_locations.data(), kernel_weights(w, d_weights.data()), other_ptr,
                     d_dots.data(), d_out.data(), errors.sink(), rng);

      // The CPU operator reports the same first bad entry; it writes nothing
      // then, so the rows are compared with its result once they are dropped.
      const std::vector<storage_t> core_src = for_core(src), core_other = for_core(other);
      {
        std::vector<storage_t> ignored = for_core(std::vector<storage_t>(static_cast<size_t>(slots * c.model_dim)));
        const auto status = core::scatter_slots<CoreT>(reinterpret_cast<const CoreT*>(core_src.data()), c.model_dim,
                                                       table_of(p, c), {}, nullptr, nullptr,
                                                       reinterpret_cast<CoreT*>(ignored.data()));
        expect_same_error(errors, status, TUTEL_OP_SCATTER_SLOTS);
      }
      const Problem dropped = with_bad_entries_dropped(p, c);
      const auto core_scatter = [&](const core::ChoiceWeights& view) {
        std::vector<storage_t> want = for_core(std::vector<storage_t>(static_cast<size_t>(slots * c.model_dim)));
        std::vector<acc_t> want_dots = for_core(std::vector<acc_t>(static_cast<size_t>(c.k * c.tokens)));
        EXPECT_TRUE(core::scatter_slots<CoreT>(reinterpret_cast<const CoreT*>(core_src.data()), c.model_dim,
                                               table_of(dropped, c), weighted ? view : core::ChoiceWeights{},
                                               reinterpret_cast<const CoreT*>(core_other.data()), want_dots.data(),
                                               reinterpret_cast<CoreT*>(want.data())).ok());
        want.resize(static_cast<size_t>(slots * c.model_dim));
        return std::make_pair(want, want_dots);
      };
      if (weighted) expect_same_as_converted(w, c, core_scatter);
      std::vector<storage_t> got = d_out.values();
      const std::vector<storage_t> want = core_scatter(w.view).first;
      std::vector<bool> skip;
      if (c.grouped && c.shared) skip = forget_shared_slots(dropped, c, got, want);
      EXPECT_TRUE(same_bits(got, want)) << "out";
      if (with_dots) check_dots(d_dots.values(), p, c, other, src, skip);
    }
}

Case shared(Case c) { c.shared = true; return c; }
Case bad(Case c, int n) { c.bad = n; return c; }
Case misaligned(Case c) { c.shift = 1; return c; }
Case grouped(Case c) { c.grouped = true; return c; }
Case weights_in(Case c, int dtype, Layout layout) { c.weights_dtype = dtype; c.layout = layout; return c; }

std::string case_name(const Case& c) {
  static const char* const kDtypes[] = {"f32", "f64", "f16", "bf16"};
  static const char* const kLayouts[] = {"", "_tokenmajor", "_padded"};
  return "T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_k" + std::to_string(c.k) + "_C" +
         std::to_string(c.capacity) + "_M" + std::to_string(c.model_dim) + (c.shared ? "_shared" : "") +
         (c.bad ? "_bad" + std::to_string(c.bad) : "") + (c.shift ? "_misaligned" : "") +
         (c.grouped ? "_grouped" : "") +
         (c.weights_dtype >= 0 ? std::string("_w") + kDtypes[c.weights_dtype] : std::string()) +
         kLayouts[int(c.layout)];
}

// Empty inputs, model_dim 0, capacity 0, odd sizes (scalar kernels), rows of
// whole 16-byte vectors (vector kernels) and the same misaligned, rows longer
// than one strip of a warp, many dropped choices, slots claimed several times
// (summed by several blocks), bad entries, and several blocks per launch.
// Grouped (no indices): T = 0 to 3000, k = 1 to 8, capacity T * k (as
// tutel.experts.routed: the dropped choices leave rows unclaimed) or more, a
// second expert whose rows stay zero, gathers from shared locations, bad
// (negative) locations.  Weights of every dtype in every layout.
INSTANTIATE_TEST_SUITE_P(
    Shapes, DispatchCu,
    ::testing::Values(
        Case{0, 3, 1, 4, 5}, Case{5, 2, 2, 3, 0}, Case{37, 5, 2, 0, 8}, Case{1, 1, 1, 1, 1},
        Case{150, 5, 2, 70, 7}, Case{150, 4, 3, 120, 32}, misaligned(Case{150, 4, 3, 120, 32}),
        Case{40, 3, 2, 30, 1000}, Case{200, 8, 2, 10, 16}, shared(Case{130, 8, 2, 40, 9}),
        bad(Case{37, 5, 2, 9, 7}, 4), bad(shared(Case{60, 3, 3, 20, 32}), 3),
        weights_in(Case{150, 5, 2, 70, 7}, TUTEL_WEIGHTS_BFLOAT16, Layout::kTokenMajor),
        weights_in(shared(Case{130, 8, 2, 40, 9}), TUTEL_WEIGHTS_FLOAT16, Layout::kPadded),
        weights_in(Case{150, 4, 3, 120, 32}, TUTEL_WEIGHTS_FLOAT64, Layout::kTokenMajor),
        weights_in(Case{40, 3, 2, 30, 1000}, TUTEL_WEIGHTS_FLOAT32, Layout::kTokenMajor),
        grouped(Case{0, 1, 1, 0, 8}), grouped(Case{1, 1, 1, 1, 3}), grouped(Case{2, 1, 2, 4, 16}),
        grouped(Case{3, 1, 3, 9, 0}), grouped(Case{3, 2, 8, 30, 5}),
        weights_in(grouped(Case{17, 1, 2, 34, 1000}), TUTEL_WEIGHTS_BFLOAT16, Layout::kTokenMajor),
        weights_in(grouped(Case{255, 1, 3, 765, 8}), TUTEL_WEIGHTS_FLOAT16, Layout::kTokenMajor),
        weights_in(grouped(Case{1000, 1, 8, 8000, 7}), TUTEL_WEIGHTS_FLOAT64, Layout::kTokenMajor),
        weights_in(misaligned(grouped(Case{300, 1, 2, 600, 32})), TUTEL_WEIGHTS_FLOAT32, Layout::kPadded),
        weights_in(grouped(Case{3000, 1, 2, 6000, 16}), TUTEL_WEIGHTS_BFLOAT16, Layout::kTokenMajor),
        weights_in(grouped(Case{3000, 1, 1, 3000, 3}), TUTEL_WEIGHTS_FLOAT32, Layout::kChoiceMajor),
        weights_in(bad(grouped(Case{61, 1, 4, 244, 9}), 3), TUTEL_WEIGHTS_FLOAT16, Layout::kPadded),
        weights_in(shared(grouped(Case{90, 1, 4, 50, 12})), TUTEL_WEIGHTS_BFLOAT16, Layout::kTokenMajor)),
    [](const auto& info) { return case_name(info.param); });

}  // namespace
