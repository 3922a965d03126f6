// kernels/gated_units.cu on the CPU, launched as csrc/ops/cuda/gated_units_cuda.cpp launches
// it, against csrc/core's portable gated units (the same operations in the same order with the
// host's exponential on both sides: h, d gate and d up bit for bit) and against a long double
// evaluation of the formula (within the accumulation type's and the storage type's rounding).
// SwiGLU, clamped units with and without gpt-oss' interleaved layout and offset, an unclamped
// interleaved unit; gate_up rows with padded strides and separate gates and ups; odd widths and
// row counts from 0 to 3000; values at the clamp bounds, NaN, ±inf, -0 and beyond the
// exponential's range.  gate_up rows with the per-expert bias of rows grouped by expert: 1 to
// 1000 experts (more than rows), idle experts, rows past the last expert's, padded bias rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/gated_units.h"
#include "core/scalar.h"
#include "harness.h"
#include "../../../kernels/gated_units.cu"
#include "variant_types.h"

namespace {

using namespace kernels_on_cpu;
namespace core = tutel::core;

enum UnitKind { kSwiGLU, kGptOss, kClampedHalves, kInterleavedSilu };

struct Case {
  int64_t rows, width;  // n, I
  UnitKind unit;
  int64_t row_padding;  // gate_up's (the separate tensors', the bias') row stride exceeds the row by this
  int64_t experts = 0;  // > 0: gate_up rows take the per-expert bias of this many experts
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "n=" << c.rows << " I=" << c.width << " unit=" << int(c.unit) << " padding=" << c.row_padding
       << " experts=" << c.experts;
}

core::GatedUnit unit_of(UnitKind kind) {
  switch (kind) {
    case kGptOss: return core::GatedUnit{1.702, 1.0, true, 7.0, true};
    case kClampedHalves: return core::GatedUnit{0.5, -0.25, true, 3.0, false};
    case kInterleavedSilu: return core::GatedUnit{1.0, 0.0, false, 0.0, true};
    default: return core::GatedUnit{1.0, 0.0, false, 0.0, false};
  }
}

TutelGatedUnit kernel_unit(const core::GatedUnit& u) {
  return TutelGatedUnit{u.alpha, u.up_offset, u.limit, u.clamped ? 1 : 0};
}

// Normal values, with every 37th one special: the clamp bounds of both clamped units and just
// beyond them, NaN, ±inf, -0, and ±90 (past the float exponential's range for alpha 1.702).
std::vector<storage_t> unit_values(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 4.f);
  const float specials[] = {7.f, -7.f, 7.5f, -7.5f, 3.f, -3.f, std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            -0.f, 90.f, -90.f};
  std::vector<storage_t> v(static_cast<size_t>(n > 0 ? n : 0));
  for (size_t i = 0; i < v.size(); ++i) v[i] = storage_of(i % 37 == 5 ? specials[(i / 37) % 12] : dist(rng));
  return v;
}

const CoreT* core_of(const std::vector<storage_t>& v) { return reinterpret_cast<const CoreT*>(v.data()); }
CoreT* core_of(std::vector<storage_t>& v) { return reinterpret_cast<CoreT*>(v.data()); }
long double value_of(storage_t v) { return (long double)to_acc(v); }

// The largest difference from the exact result that rounding allows: the accumulation type's
// (a few operations, `magnitude` the size of the terms) and then one rounding to storage_t.
::testing::AssertionResult close_to_exact(storage_t got_bits, long double exact, long double magnitude) {
  const long double got = value_of(got_bits);
  if (got == exact) return ::testing::AssertionSuccess();  // also a gradient that does not pass
  if (std::isnan(exact) || std::isnan(got)) {
    if (std::isnan(exact) && std::isnan(got)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << double(got) << ", exact " << double(exact);
  }
  if (std::isinf(exact) || std::isinf(got)) {
    if (got == exact) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << double(got) << ", exact " << double(exact);
  }
  const long double acc_eps = sizeof(acc_t) == 8 ? 0x1p-53L : 0x1p-24L;
#if defined(TUTEL_DTYPE_FLOAT16)
  const long double store_eps = 0x1p-11L, tiny = 0x1p-24L;
#elif defined(TUTEL_DTYPE_BFLOAT16)
  const long double store_eps = 0x1p-8L, tiny = 0x1p-133L;
#else
  const long double store_eps = 0, tiny = 0;
#endif
  const long double bound = 24 * acc_eps * magnitude * (1 + store_eps) + store_eps * std::fabs(exact) + tiny;
  if (std::fabs(got - exact) <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << double(got) << ", exact " << double(exact) << ", bound "
                                       << double(bound);
}

// The unit in long double from g, u (the stored values, or with the bias their sums in the
// accumulation type, which is the operator's rule) and d h: h, d g, d u and the terms' sizes.
struct Exact {
  long double h, dg, du, h_size, dg_size, du_size;
};
Exact exact_unit(const core::GatedUnit& unit, long double g_in, long double u_in, storage_t dh_bits) {
  const long double dh = value_of(dh_bits);
  const long double limit = unit.limit, alpha = unit.alpha, offset = unit.up_offset;
  long double g = g_in, u = u_in;
  if (unit.clamped) {
    if (g > limit) g = limit;
    if (u > limit) u = limit;
    else if (u < -limit) u = -limit;
  }
  const long double s = 1 / (1 + std::exp(-alpha * g));
  const bool gate_passes = !unit.clamped || g_in <= limit;
  const bool up_passes = !unit.clamped || (u_in >= -limit && u_in <= limit);
  Exact e;
  e.h = (u + offset) * (g * s);
  e.dg = gate_passes ? dh * (u + offset) * (s * (1 + alpha * g * (1 - s))) : 0;
  e.du = up_passes ? dh * (g * s) : 0;
  e.h_size = (std::fabs(u) + std::fabs(offset)) * std::fabs(g);
  e.dg_size = std::fabs(dh) * (std::fabs(u) + std::fabs(offset)) * (1 + std::fabs(alpha * g));
  e.du_size = std::fabs(dh * g);
  return e;
}

// Each expert's end row, non-decreasing in [0, n]: random ends (experts beyond the rows share
// ends, idle), expert 1 always idle, and rows past the last expert's unless E is a multiple of 3.
std::vector<int32_t> expert_ends(int64_t rows, int64_t experts, std::mt19937& rng) {
  std::vector<int32_t> ends(size_t(experts > 0 ? experts : 0));
  std::uniform_int_distribution<int64_t> pick(0, rows);
  for (int32_t& end : ends) end = int32_t(pick(rng));
  std::sort(ends.begin(), ends.end());
  if (experts >= 2) ends[1] = ends[0];
  if (experts > 0 && experts % 3 == 0) ends.back() = int32_t(rows);
  return ends;
}

// The reference's expert of grouped row r: a linear scan for the first e with ends[e] > r.
int64_t scanned_expert(const std::vector<int32_t>& ends, int64_t r) {
  int64_t e = 0;
  while (e < int64_t(ends.size()) && ends[size_t(e)] <= r) ++e;
  return e;
}

// Where a row's gates and ups lie: in one [n, 2I + padding] gate_up tensor (its halves, or
// alternating when interleaved), or in two [n, I + padding] tensors; and gate_up's per-expert
// bias, [E, 2I + padding] rows laid out like gate_up's, with the experts' ends.
struct Layout {
  std::vector<storage_t> first, second;  // gate_up (second unused), or gates and ups
  int64_t stride, step, up_shift;
  bool separate;
  std::vector<storage_t> bias;  // empty: no bias
  std::vector<int32_t> ends;
  int64_t bias_stride = 0;
  TutelGatedOperands operands(int64_t rows, int64_t width) const {
    const storage_t* base = first.empty() ? nullptr : first.data();
    const storage_t* up = separate ? (second.empty() ? nullptr : second.data())
                                   : (base == nullptr ? nullptr : base + up_shift);
    TutelGatedOperands p{base, stride, up, stride, step, rows, width, nullptr, nullptr, 0, nullptr, 0};
    if (!ends.empty()) {
      p.gate_bias = bias.data();
      p.up_bias = bias.data() + up_shift;
      p.bias_stride = bias_stride;
      p.expert_ends = ends.data();
      p.experts = int64_t(ends.size());
    }
    return p;
  }
  storage_t gate(int64_t r, int64_t i) const { return first[size_t(r * stride + step * i)]; }
  storage_t up(int64_t r, int64_t i) const {
    return separate ? second[size_t(r * stride + i)] : first[size_t(r * stride + up_shift + step * i)];
  }
  // g and u of unit i of row r as the operator takes them: plus the row's expert bias, summed in
  // the accumulation type, when there is one.
  long double biased_gate(int64_t r, int64_t i) const { return biased(gate(r, i), r, step * i); }
  long double biased_up(int64_t r, int64_t i) const { return biased(up(r, i), r, up_shift + step * i); }

 private:
  long double biased(storage_t value, int64_t r, int64_t at) const {
    const int64_t e = scanned_expert(ends, r);
    if (e >= int64_t(ends.size())) return value_of(value);
    return (long double)(acc_t)(to_acc(value) + to_acc(bias[size_t(e * bias_stride + at)]));
  }
};

// One element of slack: the ups' pointer is one element (interleaved) or I past the row start.
Layout make_layout(const Case& c, const core::GatedUnit& unit, bool separate, std::mt19937& rng) {
  Layout l;
  l.separate = separate;
  l.step = unit.interleaved ? 2 : 1;
  l.up_shift = unit.interleaved ? 1 : c.width;
  l.stride = (separate ? c.width : 2 * c.width) + c.row_padding;
  l.first = unit_values(c.rows * l.stride + 1, rng);
  if (separate) l.second = unit_values(c.rows * l.stride + 1, rng);
  if (!separate && c.experts > 0) {
    l.bias_stride = 2 * c.width + c.row_padding;
    l.bias = unit_values(c.experts * l.bias_stride, rng);
    l.ends = expert_ends(c.rows, c.experts, rng);
  }
  return l;
}

core::GatedRows<CoreT> core_rows(const Layout& l, const std::vector<storage_t>& grad, int64_t grad_stride,
                                 std::vector<storage_t>& out, int64_t out_stride, storage_t* out_up,
                                 int64_t out_up_stride, const Case& c) {
  const storage_t* up = l.separate ? l.second.data() : l.first.data() + l.up_shift;
  const core::GatedRows<CoreT> rows{core_of(l.first), l.stride, reinterpret_cast<const CoreT*>(up), l.stride,
                                    grad.empty() ? nullptr : core_of(grad), grad_stride,
                                    out.empty() ? nullptr : core_of(out), out_stride,
                                    reinterpret_cast<CoreT*>(out_up), out_up_stride, c.rows, c.width};
  if (l.ends.empty()) return rows;
  return core::with_grouped_bias(rows, l.step == 2, core_of(l.bias), l.bias_stride, l.ends.data(),
                                 int64_t(l.ends.size()));
}

const char* unit_name(UnitKind kind) {
  switch (kind) {
    case kGptOss: return "gpt_oss";
    case kClampedHalves: return "clamped_halves";
    case kInterleavedSilu: return "interleaved_silu";
    default: return "swiglu";
  }
}

class GatedUnitsCu : public ::testing::TestWithParam<Case> {};

void check_layout(const Case& c, bool separate) {
  const core::GatedUnit unit = unit_of(c.unit);
  if (separate && unit.interleaved) return;  // separate gates and ups are never interleaved
  std::mt19937 rng(unsigned(c.rows * 7 + c.width * 3 + int(c.unit) * 101 + c.row_padding + separate +
                            c.experts * 13));
  const Layout l = make_layout(c, unit, separate, rng);
  const std::vector<storage_t> grad = unit_values(c.rows * c.width, rng);
  const TutelGatedOperands operands = l.operands(c.rows, c.width);
  // d gate and d up: one [n, 2I] tensor in gate_up's layout, or two [n, I] tensors.
  const int64_t d_stride = separate ? c.width : 2 * c.width;
  const int64_t d_up_shift = separate ? 0 : l.up_shift;

  // The portable core kernels, which the CPU operator runs where AVX2 is missing.
  std::vector<storage_t> want_h = garbage<storage_t>(c.rows * c.width);
  std::vector<storage_t> want_d = garbage<storage_t>(c.rows * d_stride), want_d_up;
  if (separate) want_d_up = garbage<storage_t>(c.rows * c.width);
  std::vector<storage_t> none;
  if (c.rows > 0 && c.width > 0) {
    const auto& portable = core::portable_gated_kernels<CoreT>();
    portable.forward(unit, core_rows(l, none, 0, want_h, c.width, nullptr, 0, c), 0, c.rows);
    storage_t* want_up = separate ? want_d_up.data() : want_d.data() + d_up_shift;
    portable.backward(unit, core_rows(l, grad, c.width, want_d, d_stride, want_up, d_stride, c), 0, c.rows);
  }

  const auto grid = tutel::cuda::plan_gated_units(c.rows, c.width);
  for (const LaunchOptions& options : schedules_for_case(int(c.rows + c.width + separate))) {
    SCOPED_TRACE(::testing::Message() << "schedule " << int(options.schedule) << (separate ? " separate" : ""));
    std::vector<storage_t> h = garbage<storage_t>(c.rows * c.width);
    std::vector<storage_t> d = garbage<storage_t>(c.rows * d_stride), d_up_separate;
    if (separate) d_up_separate = garbage<storage_t>(c.rows * c.width);
    storage_t* d_ptr = d.empty() ? nullptr : d.data();
    storage_t* d_up = separate ? (d_up_separate.empty() ? nullptr : d_up_separate.data())
                               : (d_ptr == nullptr ? nullptr : d_ptr + d_up_shift);
    TUTEL_EMULATED_LAUNCH(gated_unit_forward, grid, options, operands, h.empty() ? nullptr : h.data(), c.width,
                          kernel_unit(unit));
    TUTEL_EMULATED_LAUNCH(gated_unit_backward, grid, options, operands, grad.empty() ? nullptr : grad.data(),
                          c.width, d_ptr, d_stride, d_up, d_stride, kernel_unit(unit));
    EXPECT_TRUE(same_bits(h, want_h)) << "h";
    EXPECT_TRUE(same_bits(d, want_d)) << "d gate (and d up)";
    if (separate) {
      EXPECT_TRUE(same_bits(d_up_separate, want_d_up)) << "d up";
    }

    // Against the formula in long double.
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t i = 0; i < c.width; ++i) {
        const Exact e = exact_unit(unit, l.biased_gate(r, i), l.biased_up(r, i), grad[size_t(r * c.width + i)]);
        const storage_t got_dg = d[size_t(r * d_stride + (separate ? i : l.step * i))];
        const storage_t got_du = separate ? d_up_separate[size_t(r * c.width + i)]
                                          : d[size_t(r * d_stride + d_up_shift + l.step * i)];
        ASSERT_TRUE(close_to_exact(h[size_t(r * c.width + i)], e.h, e.h_size)) << "h at " << r << ", " << i;
        ASSERT_TRUE(close_to_exact(got_dg, e.dg, e.dg_size)) << "d gate at " << r << ", " << i;
        ASSERT_TRUE(close_to_exact(got_du, e.du, e.du_size)) << "d up at " << r << ", " << i;
      }
  }
}

TEST_P(GatedUnitsCu, GateUpRowsMatchCoreAndFormula) { check_layout(GetParam(), false); }

TEST_P(GatedUnitsCu, SeparateGatesAndUpsMatchCoreAndFormula) { check_layout(GetParam(), true); }

// gate_up rows with the per-expert bias (gated_unit's bias and offsets).
class GatedUnitsBiasCu : public ::testing::TestWithParam<Case> {};

TEST_P(GatedUnitsBiasCu, GateUpRowsWithExpertBiasMatchCoreAndFormula) { check_layout(GetParam(), false); }

// One thread per unit of the flattened result.
TEST(GatedUnitsPlan, OneThreadPerUnit) {
  EXPECT_TRUE(tutel::cuda::grid_is_empty(tutel::cuda::plan_gated_units(0, 5)));
  EXPECT_TRUE(tutel::cuda::grid_is_empty(tutel::cuda::plan_gated_units(5, 0)));
  EXPECT_EQ(tutel::cuda::plan_gated_units(3, 100).x, 2);
  EXPECT_EQ(tutel::cuda::plan_gated_units(2880, 2880).x, (2880 * 2880 + 255) / 256);
}

// Empty, tiny and odd sizes, one row per block and many rows per block, row counts to 3000.
INSTANTIATE_TEST_SUITE_P(
    Shapes, GatedUnitsCu,
    ::testing::Values(Case{0, 4, kSwiGLU, 0}, Case{3, 0, kGptOss, 0}, Case{1, 1, kSwiGLU, 0},
                      Case{1, 1, kGptOss, 0}, Case{2, 3, kClampedHalves, 1}, Case{5, 7, kInterleavedSilu, 0},
                      Case{37, 19, kGptOss, 3}, Case{37, 19, kSwiGLU, 2}, Case{9, 257, kClampedHalves, 0},
                      Case{4, 300, kGptOss, 1}, Case{130, 33, kInterleavedSilu, 5}, Case{3000, 3, kGptOss, 0},
                      Case{2999, 5, kSwiGLU, 1}, Case{64, 32, kSwiGLU, 0}, Case{3000, 1, kClampedHalves, 0}),
    [](const auto& info) {
      const Case& c = info.param;
      return "n" + std::to_string(c.rows) + "_I" + std::to_string(c.width) + "_" + unit_name(c.unit) + "_pad" +
             std::to_string(c.row_padding);
    });

// The per-expert bias: n = 0 and I = 0 with experts, one row, one expert, 64 to 1000 experts
// (more experts than rows: most idle), rows past the last expert's (E not a multiple of 3),
// padded bias rows, several blocks, every unit.
INSTANTIATE_TEST_SUITE_P(
    Shapes, GatedUnitsBiasCu,
    ::testing::Values(Case{0, 4, kGptOss, 0, 3}, Case{5, 0, kGptOss, 0, 2}, Case{1, 1, kSwiGLU, 0, 1},
                      Case{1, 1, kGptOss, 0, 3}, Case{7, 5, kGptOss, 1, 1}, Case{37, 19, kGptOss, 3, 4},
                      Case{37, 19, kSwiGLU, 2, 64}, Case{130, 33, kInterleavedSilu, 5, 65},
                      Case{9, 257, kClampedHalves, 0, 3}, Case{3000, 3, kGptOss, 0, 300},
                      Case{2999, 5, kSwiGLU, 1, 64}, Case{100, 8, kGptOss, 0, 1000},
                      Case{513, 16, kClampedHalves, 2, 7}),
    [](const auto& info) {
      const Case& c = info.param;
      return "n" + std::to_string(c.rows) + "_I" + std::to_string(c.width) + "_" + unit_name(c.unit) + "_pad" +
             std::to_string(c.row_padding) + "_E" + std::to_string(c.experts);
    });

}  // namespace
