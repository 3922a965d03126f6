// Gated units: the portable and the AVX2 kernels (when this CPU has them) against double
// arithmetic, forward and backward, both layouts, clamped or not, every storage type, widths
// around the 8-unit vector blocks, row strides wider than the rows, rows split between calls,
// gates and ups in one tensor or two, and gate_up rows with the per-expert bias of grouped rows.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/gated_units.h"
#include "storage_values.h"

using namespace tutel::core;
using tutel_test::unit_rounding;
using tutel_test::value;

namespace {

const int64_t kWidths[] = {1, 7, 8, 9, 16, 37};
const GatedUnit kUnits[] = {{1.0, 0.0, false, 0.0, false},   // SwiGLU
                            {1.702, 1.0, true, 7.0, true},   // gpt-oss
                            {1.702, 1.0, true, 7.0, false},  // clamped, concatenated
                            {0.5, -2.0, false, 0.0, true}};  // offset, interleaved, no clamp

struct Expected {
  double h, dg, du, h_scale, dg_scale, du_scale;
};

// The definition in double (gradient passes at the bounds, as torch.clamp's does).
Expected expected(const GatedUnit& unit, double g_in, double u_in, double dh) {
  double g = g_in, u = u_in;
  bool gate_passes = true, up_passes = true;
  if (unit.clamped) {
    gate_passes = g_in <= unit.limit;
    up_passes = u_in >= -unit.limit && u_in <= unit.limit;
    g = std::min(g_in, unit.limit);
    u = std::max(-unit.limit, std::min(unit.limit, u_in));
  }
  const double s = 1.0 / (1.0 + std::exp(-unit.alpha * g));
  const double up = u + unit.up_offset;
  Expected e;
  e.h = up * g * s;
  e.dg = gate_passes ? dh * up * s * (1.0 + unit.alpha * g * (1.0 - s)) : 0.0;
  e.du = up_passes ? dh * g * s : 0.0;
  e.h_scale = std::fabs(up * g);
  e.dg_scale = std::fabs(dh * up) * (1.0 + std::fabs(unit.alpha * g));
  e.du_scale = std::fabs(dh * g);
  return e;
}

// One unit's h, d gate and d up against the definition in double at g and u, to the storage
// type's rounding.
template <class T>
void expect_unit_at(const GatedUnit& unit, double g, double u, T dh, T h, T dg, T du, int64_t row, int64_t i) {
  const double tolerance = 8 * (unit_rounding(T()) + std::ldexp(1.0, -21));
  const Expected e = expected(unit, g, u, value(dh));
  EXPECT_NEAR(value(h), e.h, tolerance * e.h_scale + 1e-30) << "h row " << row << " unit " << i;
  EXPECT_NEAR(value(dg), e.dg, tolerance * e.dg_scale + 1e-30) << "d gate row " << row << " unit " << i;
  EXPECT_NEAR(value(du), e.du, tolerance * e.du_scale + 1e-30) << "d up row " << row << " unit " << i;
}

template <class T>
void expect_unit(const GatedUnit& unit, T g, T u, T dh, T h, T dg, T du, int64_t row, int64_t i) {
  expect_unit_at(unit, value(g), value(u), dh, h, dg, du, row, i);
}

template <class T>
void check_kernels(const GatedKernels<T>& kernels, const GatedUnit& unit, int64_t width, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 5.f);
  const int64_t rows = 5, in_stride = 2 * width + 3, grad_stride = width + 2;
  std::vector<T> gate_up(rows * in_stride), grad(rows * grad_stride), h(rows * (width + 1)),
      d(rows * (2 * width + 1));
  for (auto& v : gate_up) v = Scalar<T>::store(dist(rng));
  for (auto& v : grad) v = Scalar<T>::store(dist(rng) / 5.f);
  if (unit.clamped) {  // the bounds themselves
    gate_up[0] = Scalar<T>::store(float(unit.limit));
    gate_up[unit.interleaved ? 1 : width] = Scalar<T>::store(float(-unit.limit));
  }
  const T sentinel = Scalar<T>::store(12345.f);
  for (auto& v : h) v = sentinel;
  for (auto& v : d) v = sentinel;
  const GatedRows<T> forward = concatenated_gate_up<T>(unit.interleaved, gate_up.data(), in_stride, nullptr, 0,
                                                       h.data(), width + 1, nullptr, 0, rows, width);
  const GatedRows<T> backward = concatenated_gate_up<T>(unit.interleaved, gate_up.data(), in_stride, grad.data(),
                                                        grad_stride, nullptr, 0, d.data(), 2 * width + 1, rows, width);
  // Two row ranges, as two threads would take them.
  kernels.forward(unit, forward, 0, 2);
  kernels.forward(unit, forward, 2, rows);
  kernels.backward(unit, backward, 0, 3);
  kernels.backward(unit, backward, 3, rows);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(value(h[r * (width + 1) + width]), value(sentinel)) << "wrote past h's row";
    EXPECT_EQ(value(d[r * (2 * width + 1) + 2 * width]), value(sentinel)) << "wrote past d gate_up's row";
    for (int64_t i = 0; i < width; ++i) {
      const int64_t gc = unit.interleaved ? 2 * i : i, uc = unit.interleaved ? 2 * i + 1 : width + i;
      expect_unit(unit, gate_up[r * in_stride + gc], gate_up[r * in_stride + uc], grad[r * grad_stride + i],
                  h[r * (width + 1) + i], d[r * (2 * width + 1) + gc], d[r * (2 * width + 1) + uc], r, i);
    }
  }
}

// gate_up rows with the per-expert bias: 3 experts over 8 rows (expert 1 idle, the last row past
// the last expert's, taking no bias), bias rows wider than 2I.  g and u are gate_up's values plus
// the bias, summed in the accumulation type (the operator's rule), then the definition in double.
template <class T>
void check_biased_kernels(const GatedKernels<T>& kernels, const GatedUnit& unit, int64_t width, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 5.f);
  const int64_t rows = 8, in_stride = 2 * width + 3, grad_stride = width, bias_stride = 2 * width + 1;
  const int32_t ends[] = {3, 3, 7};
  const int64_t row_expert[] = {0, 0, 0, 2, 2, 2, 2, 3};  // 3: none
  std::vector<T> gate_up(rows * in_stride), grad(rows * grad_stride), bias(3 * bias_stride), h(rows * width),
      d(rows * 2 * width);
  for (auto& v : gate_up) v = Scalar<T>::store(dist(rng));
  for (auto& v : grad) v = Scalar<T>::store(dist(rng) / 5.f);
  for (auto& v : bias) v = Scalar<T>::store(dist(rng));
  const GatedRows<T> forward = with_grouped_bias(
      concatenated_gate_up<T>(unit.interleaved, gate_up.data(), in_stride, nullptr, 0, h.data(), width, nullptr, 0,
                              rows, width),
      unit.interleaved, bias.data(), bias_stride, ends, 3);
  const GatedRows<T> backward = with_grouped_bias(
      concatenated_gate_up<T>(unit.interleaved, gate_up.data(), in_stride, grad.data(), grad_stride, nullptr, 0,
                              d.data(), 2 * width, rows, width),
      unit.interleaved, bias.data(), bias_stride, ends, 3);
  kernels.forward(unit, forward, 0, 4);
  kernels.forward(unit, forward, 4, rows);
  kernels.backward(unit, backward, 0, 5);
  kernels.backward(unit, backward, 5, rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; ++i) {
      const int64_t gc = unit.interleaved ? 2 * i : i, uc = unit.interleaved ? 2 * i + 1 : width + i;
      double g = value(gate_up[r * in_stride + gc]), u = value(gate_up[r * in_stride + uc]);
      if (row_expert[r] < 3) {
        using A = acc_t<T>;
        g = double(A(g) + A(value(bias[row_expert[r] * bias_stride + gc])));
        u = double(A(u) + A(value(bias[row_expert[r] * bias_stride + uc])));
      }
      expect_unit_at(unit, g, u, grad[r * grad_stride + i], h[r * width + i], d[r * 2 * width + gc],
                     d[r * 2 * width + uc], r, i);
    }
  }
}

// Gates and ups in two tensors of different row strides (llama_ffn's separate products), and
// the backward's d gate and d up into two more.
template <class T>
void check_separate_kernels(const GatedKernels<T>& kernels, const GatedUnit& unit, int64_t width, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 5.f);
  const int64_t rows = 5, gate_stride = width + 3, up_stride = width + 5, grad_stride = width + 2;
  const int64_t h_stride = width + 1, dg_stride = width + 4, du_stride = width + 1;
  std::vector<T> gate(rows * gate_stride), up(rows * up_stride), grad(rows * grad_stride), h(rows * h_stride),
      dg(rows * dg_stride), du(rows * du_stride);
  for (auto& v : gate) v = Scalar<T>::store(dist(rng));
  for (auto& v : up) v = Scalar<T>::store(dist(rng));
  for (auto& v : grad) v = Scalar<T>::store(dist(rng) / 5.f);
  const T sentinel = Scalar<T>::store(12345.f);
  for (auto* buffer : {&h, &dg, &du}) {
    for (auto& v : *buffer) v = sentinel;
  }
  const GatedRows<T> forward{gate.data(), gate_stride, up.data(), up_stride, nullptr, 0,
                             h.data(), h_stride, nullptr, 0, rows, width};
  const GatedRows<T> backward{gate.data(), gate_stride, up.data(), up_stride, grad.data(), grad_stride,
                              dg.data(), dg_stride, du.data(), du_stride, rows, width};
  kernels.forward(unit, forward, 0, 3);
  kernels.forward(unit, forward, 3, rows);
  kernels.backward(unit, backward, 0, 1);
  kernels.backward(unit, backward, 1, rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = width; i < h_stride; ++i) EXPECT_EQ(value(h[r * h_stride + i]), value(sentinel));
    for (int64_t i = width; i < dg_stride; ++i) EXPECT_EQ(value(dg[r * dg_stride + i]), value(sentinel));
    for (int64_t i = width; i < du_stride; ++i) EXPECT_EQ(value(du[r * du_stride + i]), value(sentinel));
    for (int64_t i = 0; i < width; ++i) {
      expect_unit(unit, gate[r * gate_stride + i], up[r * up_stride + i], grad[r * grad_stride + i],
                  h[r * h_stride + i], dg[r * dg_stride + i], du[r * du_stride + i], r, i);
    }
  }
}

// At special gates and ups (±inf, NaN, -0, ±90, the clamp bounds) the AVX2 kernels give what the
// portable ones give: the same NaN places, and equal values elsewhere to a few float ulps (their
// exponentials differ by that much).  sigmoid(-inf) is 0 in both, so h = u g s is NaN at g = -inf.
template <class T>
void check_special_values_agree(const GatedKernels<T>& vector, const GatedUnit& unit) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float specials[] = {-inf, inf, nan, -0.0f, 90.f, -90.f, 7.f, -7.f, 88.5f, -88.5f, 1.5f, -2.f};
  const int64_t width = 16, rows = 12, in_stride = 2 * width;
  std::vector<T> gate_up(rows * in_stride), grad(rows * width);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < in_stride; ++c)  // every gate meets every up across the rows
      gate_up[r * in_stride + c] = Scalar<T>::store(specials[(c + (c % 2 ? r : 0)) % 12]);
  for (int64_t i = 0; i < rows * width; ++i) grad[i] = Scalar<T>::store(specials[(i * 5 + 10) % 12] / 3.f);
  std::vector<T> h[2], d[2];
  const GatedKernels<T>* kernels[2] = {&portable_gated_kernels<T>(), &vector};
  for (int k = 0; k < 2; ++k) {
    h[k].resize(rows * width);
    d[k].resize(rows * in_stride);
    kernels[k]->forward(unit, concatenated_gate_up<T>(unit.interleaved, gate_up.data(), in_stride, nullptr, 0,
                                                      h[k].data(), width, nullptr, 0, rows, width),
                        0, rows);
    kernels[k]->backward(unit, concatenated_gate_up<T>(unit.interleaved, gate_up.data(), in_stride, grad.data(),
                                                       width, nullptr, 0, d[k].data(), in_stride, rows, width),
                         0, rows);
  }
  const double tolerance = 8 * (unit_rounding(T()) + std::ldexp(1.0, -21));
  auto agree = [&](const std::vector<T>& want, const std::vector<T>& got, const char* what) {
    for (size_t i = 0; i < want.size(); ++i) {
      const double w = value(want[i]), g = value(got[i]);
      if (std::isnan(w) || std::isnan(g) || std::isinf(w) || std::isinf(g)) {
        EXPECT_TRUE((std::isnan(w) && std::isnan(g)) || w == g) << what << " " << i << ": " << g << " (AVX2), "
                                                                << w << " (portable)";
      } else {
        EXPECT_NEAR(g, w, tolerance * std::fabs(w) + 1e-30) << what << " " << i;
      }
    }
  };
  agree(h[0], h[1], "h");
  agree(d[0], d[1], "d gate_up");
}

template <class T>
void check_all() {
  std::mt19937 rng(7);
  for (const GatedUnit& unit : kUnits) {
    for (int64_t width : kWidths) {
      check_kernels(portable_gated_kernels<T>(), unit, width, rng);
      if (const GatedKernels<T>* avx2 = avx2_gated_kernels<T>()) check_kernels(*avx2, unit, width, rng);
      check_biased_kernels(portable_gated_kernels<T>(), unit, width, rng);
      if (const GatedKernels<T>* avx2 = avx2_gated_kernels<T>()) check_biased_kernels(*avx2, unit, width, rng);
      if (width == kWidths[0]) {
        if (const GatedKernels<T>* avx2 = avx2_gated_kernels<T>()) check_special_values_agree(*avx2, unit);
      }
      if (!unit.interleaved) {
        check_separate_kernels(portable_gated_kernels<T>(), unit, width, rng);
        if (const GatedKernels<T>* avx2 = avx2_gated_kernels<T>()) check_separate_kernels(*avx2, unit, width, rng);
      }
    }
  }
}

}  // namespace

TEST(GatedUnits, FloatMatchesDouble) { check_all<float>(); }
TEST(GatedUnits, DoubleMatchesDouble) { check_all<double>(); }
TEST(GatedUnits, BFloat16MatchesDouble) { check_all<bfloat16>(); }
TEST(GatedUnits, Float16MatchesDouble) { check_all<float16>(); }
