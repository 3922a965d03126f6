// kernels/expert_rows.cu on the CPU, launched as csrc/ops/cuda/expert_rows_cuda.cpp launches it,
// against plain loops that follow the CPU operators (csrc/ops/cpu/expert_rows_cpu.cpp): each
// row's expert found by walking the ends, the bias added in the accumulation type with csrc/core's
// conversions and rounded once, each expert's sum taken row by row from +0 in the accumulation
// type.  Results bit for bit (any NaN equal to any NaN), the sums also within the accumulation
// type's rounding of a long double sum.  Rows through padded strides, 16-byte vectors and
// element-wise (misaligned pointers, odd widths), idle experts, rows past the last expert's, one
// expert and 300, empty inputs; NaN, ±inf, -0, overflow and subnormals among the values; slot
// choices outside [0, T k); ends out of order or beyond [0, N], which must not lead outside the
// tensors (the AddressSanitizer build sees every access past a buffer).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/scalar.h"
#include "harness.h"
#include "../../../kernels/expert_rows.cu"
#include "exact_sums.h"
#include "variant_types.h"

namespace {

using namespace kernels_on_cpu;
namespace core = tutel::core;
using Scalar = core::Scalar<CoreT>;
using acc = core::acc_t<CoreT>;

constexpr int64_t kWidth = TUTEL_VECTOR_WIDTH;

struct Case {
  int64_t rows, columns, experts;
  int64_t padding;  // row stride = columns + padding
  int64_t tail;     // rows past the last expert's
  int shift;        // elements the data starts past a 16-byte boundary (1: element-wise kernels)
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "N=" << c.rows << " C=" << c.columns << " E=" << c.experts << " padding=" << c.padding
       << " tail=" << c.tail << " shift=" << c.shift;
}

storage_t from_double(double v) {
#if defined(TUTEL_DTYPE_FLOAT64)
  return v;
#else
  return storage_of(float(v));
#endif
}

acc load(storage_t v) {
  CoreT c;
  std::memcpy(&c, &v, sizeof(c));
  return Scalar::load(c);
}

storage_t store(acc v) {
  const CoreT c = Scalar::store(v);
  storage_t s;
  std::memcpy(&s, &c, sizeof(s));
  return s;
}

bool is_nan(storage_t v) { return std::isnan(load(v)); }

// Normal values (float64 ones use all 53 bits), with every 29th one special: NaN, ±inf, -0, a
// large value whose sums overflow float16, and a float16 subnormal.
std::vector<storage_t> random_values(int64_t n, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, 2.0);
  const double specials[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity(), -0.0, 60000.0, 3e-6};
  std::vector<storage_t> v(size_t(n > 0 ? n : 0));
  for (size_t i = 0; i < v.size(); ++i) v[i] = from_double(i % 29 == 11 ? specials[(i / 29) % 6] : dist(rng));
  return v;
}

// Bits equal, or both NaN (float16 NaN payloads are not modelled).
::testing::AssertionResult same_values(const std::vector<storage_t>& got, const std::vector<storage_t>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes " << got.size() << ", " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(storage_t)) == 0 || (is_nan(got[i]) && is_nan(want[i]))) continue;
    return ::testing::AssertionFailure() << "first difference at element " << i << " of " << got.size() << ": got "
                                         << double(load(got[i])) << ", want " << double(load(want[i]));
  }
  return ::testing::AssertionSuccess();
}

// Non-decreasing ends: random group sizes, about a third of the experts idle, summing to
// rows - tail.
std::vector<int> random_ends(int64_t experts, int64_t grouped, std::mt19937& rng) {
  std::vector<double> weights(static_cast<size_t>(experts));
  std::uniform_real_distribution<double> share(0.0, 1.0);
  double total = 0;
  for (auto& w : weights) {
    w = share(rng) < 0.33 ? 0.0 : share(rng);
    total += w;
  }
  std::vector<int> ends(static_cast<size_t>(experts));
  double running = 0;
  for (size_t e = 0; e < ends.size(); ++e) {
    running += weights[e];
    ends[e] = total > 0 ? int(std::floor(running / total * double(grouped))) : 0;
  }
  if (!ends.empty()) ends.back() = int(grouped);  // every grouped row has an expert
  return ends;
}

// The first e with ends[e] > row, walked (not searched), as the CPU operator advances.
int64_t walked_expert(const std::vector<int>& ends, int64_t row) {
  int64_t e = 0;
  while (e < int64_t(ends.size()) && ends[size_t(e)] <= row) ++e;
  return e;
}

// A row-strided [rows, columns] tensor: its memory (exactly (rows - 1) * stride + columns
// elements, `shift` past a 16-byte boundary) and its stride.
struct Rows {
  int64_t rows, columns, stride;
  std::vector<storage_t> values;
  int64_t size() const { return rows == 0 ? 0 : (rows - 1) * stride + columns; }
  storage_t at(int64_t r, int64_t c) const { return values[size_t(r * stride + c)]; }
};

Rows random_rows(int64_t rows, int64_t columns, int64_t stride, std::mt19937& rng) {
  Rows r{rows, columns, stride, {}};
  r.values = random_values(r.size(), rng);
  return r;
}

// ------------------------------------------------------------------------------ add_expert_bias

std::vector<storage_t> biased(const Rows& rows, const std::vector<storage_t>& bias, const std::vector<int>& ends) {
  std::vector<storage_t> want = rows.values;
  const int64_t grouped = ends.empty() ? 0 : ends.back();
  for (int64_t r = 0; r < grouped; ++r) {
    const int64_t e = walked_expert(ends, r);
    for (int64_t c = 0; c < rows.columns; ++c)
      want[size_t(r * rows.stride + c)] = store(load(rows.at(r, c)) + load(bias[size_t(e * rows.columns + c)]));
  }
  return want;
}

std::vector<storage_t> add_on_device(const Rows& rows, const std::vector<storage_t>& bias,
                                     const std::vector<int>& ends, int shift, const LaunchOptions& options,
                                     bool* vector) {
  DeviceBuffer<storage_t> data(rows.values, shift), shifts(bias, shift);
  DeviceBuffer<int> ends_buffer(ends);
  const auto plan = tutel::cuda::plan_expert_rows(rows.rows, rows.columns, sizeof(storage_t),
                                                  {data.data(), shifts.data()}, {rows.stride, rows.columns});
  if (vector != nullptr) *vector = plan.vector;
  TUTEL_EMULATED_LAUNCH(add_expert_bias, plan.grid, options, data.data(), rows.stride, shifts.data(), rows.columns,
                        ends_buffer.data(), int64_t(ends.size()), rows.rows, rows.columns, plan.vector ? 1 : 0);
  return data.values();
}

// ------------------------------------------------------------------------------ expert_row_sums

std::vector<storage_t> summed(const Rows& rows, const std::vector<int>& ends) {
  std::vector<storage_t> want(ends.size() * size_t(rows.columns));
  for (size_t e = 0; e < ends.size(); ++e)
    for (int64_t c = 0; c < rows.columns; ++c) {
      acc sum = acc(0);
      for (int64_t r = e == 0 ? 0 : ends[e - 1]; r < ends[e]; ++r) sum += load(rows.at(r, c));
      want[e * size_t(rows.columns) + size_t(c)] = store(sum);
    }
  return want;
}

std::vector<storage_t> sum_on_device(const Rows& rows, const std::vector<int>& ends, int shift,
                                     const LaunchOptions& options) {
  DeviceBuffer<storage_t> data(rows.values, shift);
  DeviceBuffer<int> ends_buffer(ends);
  const int64_t experts = int64_t(ends.size());
  DeviceBuffer<storage_t> out(experts * rows.columns);  // starts as garbage
  TUTEL_EMULATED_LAUNCH(expert_row_sums, tutel::cuda::plan_expert_row_sums(experts, rows.columns), options,
                        data.data(), rows.stride, ends_buffer.data(), experts, rows.rows, rows.columns, out.data());
  return out.values();
}

// Each sum within the accumulation type's rounding of the exact (long double) sum of its rows,
// then one rounding to the data type; only where the exact sum is finite.
void expect_sums_near_exact(const std::vector<storage_t>& got, const Rows& rows, const std::vector<int>& ends) {
  for (size_t e = 0; e < ends.size(); ++e)
    for (int64_t c = 0; c < rows.columns; ++c) {
      long double exact = 0, magnitude = 0;
      int64_t terms = 0;
      for (int64_t r = e == 0 ? 0 : ends[e - 1]; r < ends[e]; ++r, ++terms) {
        exact += value_of(rows.at(r, c));
        magnitude += std::fabs(value_of(rows.at(r, c)));
      }
      if (!std::isfinite(double(magnitude))) continue;
      const long double value = value_of(got[e * size_t(rows.columns) + size_t(c)]);
      if (std::isinf(double(value))) continue;  // float16 overflow, checked bit for bit above
      const long double bound = (terms + 1) * kAccEps * magnitude * (1 + kDataEps) + kDataEps * std::fabs(exact) +
                                kDataTiny;
      ASSERT_LE(std::fabs(value - exact), bound) << "expert " << e << ", column " << c;
    }
}

// --------------------------------------------------------------------------------- choice_rows

std::vector<storage_t> chosen(const Rows& x, const std::vector<int64_t>& choices, int64_t k) {
  std::vector<storage_t> want(choices.size() * size_t(x.columns), from_double(0.0));
  for (size_t s = 0; s < choices.size(); ++s) {
    if (choices[s] < 0 || choices[s] >= x.rows * k) continue;  // a zero row
    for (int64_t c = 0; c < x.columns; ++c) want[s * size_t(x.columns) + size_t(c)] = x.at(choices[s] / k, c);
  }
  return want;
}

std::vector<storage_t> choose_on_device(const Rows& x, const std::vector<int64_t>& choices, int64_t k, int shift,
                                        const LaunchOptions& options, bool* vector) {
  DeviceBuffer<storage_t> data(x.values, shift);
  std::vector<long long> choice_values(choices.begin(), choices.end());
  DeviceBuffer<long long> choice_buffer(choice_values);
  const int64_t slots = int64_t(choices.size());
  DeviceBuffer<storage_t> out(slots * x.columns);  // garbage; an aligned fresh tensor, as at::empty gives
  const auto plan =
      tutel::cuda::plan_expert_rows(slots, x.columns, sizeof(storage_t), {data.data(), out.data()}, {x.stride});
  if (vector != nullptr) *vector = plan.vector;
  TUTEL_EMULATED_LAUNCH(choice_rows, plan.grid, options, data.data(), x.stride, x.rows, choice_buffer.data(), k, slots,
                        x.columns, out.data(), plan.vector ? 1 : 0);
  return out.values();
}

// A permutation of the T k choices (group_by_expert's slot choices), every 13th slot replaced by
// a choice outside [0, T k) when `bad`.
std::vector<int64_t> slot_choices(int64_t tokens, int64_t k, bool bad, std::mt19937& rng) {
  std::vector<int64_t> choices(size_t(tokens * k));
  for (size_t i = 0; i < choices.size(); ++i) choices[i] = int64_t(i);
  std::shuffle(choices.begin(), choices.end(), rng);
  if (bad) {
    const int64_t outside[] = {-1, tokens * k, tokens * k + 12345, std::numeric_limits<int64_t>::min(),
                               std::numeric_limits<int64_t>::max()};
    for (size_t i = 5; i < choices.size(); i += 13) choices[i] = outside[(i / 13) % 5];
  }
  return choices;
}

// ------------------------------------------------------------------------------------ the tests

class ExpertRowsCu : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertRowsCu, BiasMatchesTheLoopBitForBit) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.rows * 31 + c.columns * 7 + c.experts * 3 + c.padding + c.shift));
  const Rows rows = random_rows(c.rows, c.columns, c.columns + c.padding, rng);
  const std::vector<storage_t> bias = random_values(c.experts * c.columns, rng);
  const std::vector<int> ends = random_ends(c.experts, c.rows - c.tail, rng);
  const std::vector<storage_t> want = biased(rows, bias, ends);
  for (const LaunchOptions& options : schedules_for_case(int(c.rows + c.columns + c.experts))) {
    SCOPED_TRACE(::testing::Message() << "schedule " << int(options.schedule));
    bool vector = false;
    const std::vector<storage_t> got = add_on_device(rows, bias, ends, c.shift, options, &vector);
    // Every element: the biased rows, and the rows of no expert and the padding as they were.
    EXPECT_TRUE(same_values(got, want));
    EXPECT_EQ(vector, c.shift == 0 && c.columns % kWidth == 0 && c.padding % kWidth == 0);
  }
}

TEST_P(ExpertRowsCu, SumsMatchTheLoopBitForBitAndTheExactSum) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.rows * 17 + c.columns * 5 + c.experts + c.padding * 3 + c.shift));
  const Rows rows = random_rows(c.rows, c.columns, c.columns + c.padding, rng);
  const std::vector<int> ends = random_ends(c.experts, c.rows - c.tail, rng);
  const std::vector<storage_t> want = summed(rows, ends);
  for (const LaunchOptions& options : schedules_for_case(int(c.rows * 3 + c.columns + c.experts))) {
    SCOPED_TRACE(::testing::Message() << "schedule " << int(options.schedule));
    const std::vector<storage_t> got = sum_on_device(rows, ends, c.shift, options);
    EXPECT_TRUE(same_values(got, want));
    expect_sums_near_exact(got, rows, ends);
  }
}

// The case's rows are the tokens (T = N, k from the experts), its experts pick k.
TEST_P(ExpertRowsCu, ChoiceRowsCopyTheTokensAndZeroBadChoices) {
  const Case c = GetParam();
  const int64_t k = 1 + c.experts % 4;
  std::mt19937 rng(unsigned(c.rows * 11 + c.columns * 3 + k + c.padding + c.shift));
  const Rows x = random_rows(c.rows, c.columns, c.columns + c.padding, rng);
  for (bool bad : {false, true}) {
    const std::vector<int64_t> choices = slot_choices(c.rows, k, bad, rng);
    const std::vector<storage_t> want = chosen(x, choices, k);
    for (const LaunchOptions& options : schedules_for_case(int(c.rows + c.columns * 5 + bad))) {
      SCOPED_TRACE(::testing::Message() << "schedule " << int(options.schedule) << (bad ? " bad choices" : ""));
      bool vector = false;
      EXPECT_TRUE(same_bits(choose_on_device(x, choices, k, c.shift, options, &vector), want));
      EXPECT_EQ(vector, c.shift == 0 && c.columns % kWidth == 0 && c.padding % kWidth == 0);
    }
  }
}

// Tokens with no slots, and slots whose every choice is outside [0, T k) (T = 0 among them).
TEST(ExpertRowsCuChoices, EmptyAndAllBad) {
  std::mt19937 rng(5);
  const LaunchOptions options = schedule_for_case(3);
  const Rows x = random_rows(6, 16, 16, rng);
  EXPECT_TRUE(choose_on_device(x, {}, 2, 0, options, nullptr).empty());
  const std::vector<int64_t> bad = {-1, 12, 99, -7};
  EXPECT_TRUE(same_bits(choose_on_device(x, bad, 2, 0, options, nullptr), chosen(x, bad, 2)));
  const Rows none = random_rows(0, 16, 16, rng);
  EXPECT_TRUE(same_bits(choose_on_device(none, {0, 1, 2}, 1, 0, options, nullptr),
                        std::vector<storage_t>(3 * 16, from_double(0.0))));
}

// Ends out of order, negative or beyond N: nothing outside the tensors is read or written (exact
// buffers, checked by AddressSanitizer), the rows' padding stays, and the sums walk the ends
// clamped to [0, N] (an empty range where they are out of order).
TEST(ExpertRowsCuEnds, BadEndsStayInsideTheTensors) {
  std::mt19937 rng(9);
  const LaunchOptions options = schedule_for_case(1);
  const Rows rows = random_rows(10, 9, 12, rng);
  const std::vector<int> ends = {4, 2, 100, -3, 7, 1 << 30};
  const std::vector<storage_t> bias = random_values(int64_t(ends.size()) * rows.columns, rng);
  const std::vector<storage_t> got = add_on_device(rows, bias, ends, 0, options, nullptr);
  for (int64_t r = 0; r < rows.rows; ++r)
    for (int64_t c = rows.columns; c < rows.stride && r + 1 < rows.rows; ++c)
      EXPECT_TRUE(same_values({got[size_t(r * rows.stride + c)]}, {rows.at(r, c)})) << "padding of row " << r;
  const std::vector<storage_t> sums = sum_on_device(rows, ends, 0, options);
  for (size_t e = 0; e < ends.size(); ++e) {
    const int64_t begin = std::max<int64_t>(0, e == 0 ? 0 : ends[e - 1]), end = std::min<int64_t>(rows.rows, ends[e]);
    for (int64_t col = 0; col < rows.columns; ++col) {
      acc sum = acc(0);
      for (int64_t r = begin; r < end; ++r) sum += load(rows.at(r, col));
      EXPECT_TRUE(same_values({sums[e * size_t(rows.columns) + size_t(col)]}, {store(sum)})) << "expert " << e;
    }
  }
}

// Vectors only where the width, every pointer and every row stride allow them; one thread per
// unit of the result.
TEST(ExpertRowsPlan, VectorsWhereAlignedAndOneThreadPerUnit) {
  alignas(16) static char memory[64];
  const void* aligned = memory;
  const void* misaligned = memory + 4;
  const auto vector = tutel::cuda::plan_expert_rows(10, 64, 4, {aligned, aligned}, {64, 128});
  EXPECT_TRUE(vector.vector);
  EXPECT_EQ(vector.grid.x, 1);  // 10 * 16 vectors
  EXPECT_FALSE(tutel::cuda::plan_expert_rows(10, 64, 4, {aligned, misaligned}, {64}).vector);
  EXPECT_FALSE(tutel::cuda::plan_expert_rows(10, 64, 4, {aligned}, {66}).vector);
  EXPECT_FALSE(tutel::cuda::plan_expert_rows(10, 62, 4, {aligned}, {64}).vector);
  EXPECT_TRUE(tutel::cuda::plan_expert_rows(10, 64, 2, {aligned}, {72}).vector);
  const auto scalar = tutel::cuda::plan_expert_rows(1000, 63, 2, {aligned}, {63});
  EXPECT_EQ(scalar.grid.x, (1000 * 63 + 255) / 256);
  EXPECT_TRUE(tutel::cuda::grid_is_empty(tutel::cuda::plan_expert_rows(0, 64, 4, {aligned}, {64}).grid));
  EXPECT_TRUE(tutel::cuda::grid_is_empty(tutel::cuda::plan_expert_row_sums(0, 64)));
  EXPECT_TRUE(tutel::cuda::grid_is_empty(tutel::cuda::plan_expert_row_sums(8, 0)));
  EXPECT_EQ(tutel::cuda::plan_expert_row_sums(300, 33).x, (300 * 33 + 255) / 256);
}

// Empty and tiny sizes; one expert and 300 (more experts than rows: many idle); rows past the last
// expert's; padded rows; vector widths (C a multiple of 8) and odd widths; misaligned data; up to
// 3000 rows, many blocks.
INSTANTIATE_TEST_SUITE_P(
    Shapes, ExpertRowsCu,
    ::testing::Values(Case{0, 8, 3, 0, 0, 0}, Case{5, 0, 2, 0, 1, 0}, Case{4, 16, 0, 0, 4, 0},
                      Case{1, 1, 1, 0, 0, 0}, Case{1, 8, 1, 0, 1, 0}, Case{7, 3, 2, 1, 2, 0},
                      Case{64, 16, 64, 0, 0, 0}, Case{64, 16, 65, 8, 5, 0}, Case{37, 40, 5, 8, 3, 1},
                      Case{130, 24, 9, 0, 17, 0}, Case{300, 33, 300, 2, 0, 0}, Case{513, 8, 64, 16, 40, 0},
                      Case{200, 64, 7, 0, 0, 1}, Case{3000, 3, 16, 0, 100, 0}, Case{2999, 8, 128, 8, 0, 0}),
    [](const auto& info) {
      const Case& c = info.param;
      return "N" + std::to_string(c.rows) + "_C" + std::to_string(c.columns) + "_E" + std::to_string(c.experts) +
             "_pad" + std::to_string(c.padding) + "_tail" + std::to_string(c.tail) + "_shift" +
             std::to_string(c.shift);
    });

}  // namespace
