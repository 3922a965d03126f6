// kernels/grouped_rows_gemm.cu on the CPU, launched as csrc/ops/cuda/grouped_rows_linear_cuda.cpp
// launches it (the product; the row gradient with the weight read the other way; the weight and
// bias gradients), against a long double loop over the same inputs: every output within the
// accumulation type's rounding of the exact sum plus one rounding to the data type, zeros for
// the rows past the last end and the experts without rows, nothing left unwritten.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <vector>

#include "cuda/expert_launch_plan.h"
#include "harness.h"
#include "../../../kernels/grouped_rows_gemm.cu"
#include "exact_sums.h"

namespace {

using namespace kernels_on_cpu;
namespace core = tutel::core;

// A sum of `terms` products computed in acc_t in any order, then rounded to storage_t.
::testing::AssertionResult sum_close(storage_t got, long double exact, long double magnitude, int64_t terms) {
  const long double value = value_of(got);
  // Float16 results past its range round to infinity; the inputs here keep sums far below it.
  const long double bound =
      (terms + 2) * kAccEps * magnitude * 1.01L + kDataEps * std::fabs(exact) * 1.01L + kDataTiny + 1e-300L;
  if (std::fabs(value - exact) <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << double(value) << ", want " << double(exact) << " (bound "
                                       << double(bound) << ")";
}

struct Case {
  int64_t rows, experts, depth, outputs;
  std::vector<int64_t> counts;  // rows per expert; their sum may be below `rows` (a tail)
  int64_t row_padding = 0;      // extra elements per row of the row matrix (a strided view)
  std::vector<int> ends_override;  // caller-made ends (out of order, negative, past the rows)
  bool every_layout = true;        // false: one layout and bias choice (a case of many blocks)
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "N=" << c.rows << " E=" << c.experts << " K=" << c.depth << " O=" << c.outputs;
}

// Expert e's rows [begin[e], end[e]) as the kernels read `ends`: the running maximum clamped to [0, N].
struct Groups {
  std::vector<int64_t> begin, end;
  int64_t kept() const { return end.empty() ? 0 : end.back(); }
};

Groups groups_of(const std::vector<int>& ends, int64_t rows) {
  Groups g;
  int64_t running = 0;
  for (int v : ends) {
    g.begin.push_back(running);
    running = std::max<int64_t>(running, std::min<int64_t>(std::max<int64_t>(v, 0), rows));
    g.end.push_back(running);
  }
  return g;
}

std::vector<int> ends_of(const Case& c) {
  if (!c.ends_override.empty()) return c.ends_override;
  std::vector<int> ends;
  int64_t running = 0;
  for (int64_t n : c.counts) ends.push_back(int(running += n));
  return ends;
}

std::vector<storage_t> random_values(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  std::vector<storage_t> v(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (auto& x : v) x = storage_of(dist(rng));
  return v;
}

struct Operands {
  std::vector<storage_t> rows;    // [N, K + padding]
  std::vector<storage_t> weight;  // [E, O, K], or [E, K, O] when transposed
  std::vector<storage_t> bias;    // [E, O]
  std::vector<storage_t> grad;    // [N, O]
  std::vector<int> ends;
  int64_t row_stride;
};

Operands make_operands(const Case& c, std::mt19937& rng) {
  Operands a;
  a.row_stride = c.depth + c.row_padding;
  a.rows = random_values(c.rows * a.row_stride, rng);
  a.weight = random_values(c.experts * c.outputs * c.depth, rng);
  a.bias = random_values(c.experts * c.outputs, rng);
  a.grad = random_values(c.rows * c.outputs, rng);
  a.ends = ends_of(c);
  return a;
}

long double weight_at(const Operands& a, const Case& c, bool transposed, int64_t e, int64_t o, int64_t k) {
  return value_of(transposed ? a.weight[(e * c.depth + k) * c.outputs + o] : a.weight[(e * c.outputs + o) * c.depth + k]);
}

// What grouped_rows_linear_cuda launches for the product.
std::vector<storage_t> product_on_cpu(const Operands& a, const Case& c, bool transposed, bool with_bias,
                                      const LaunchOptions& options) {
  DeviceBuffer<storage_t> rows(a.rows), weight(a.weight), bias(a.bias);
  DeviceBuffer<int> ends(a.ends);
  DeviceBuffer<storage_t> out(c.rows * c.outputs);
  TUTEL_EMULATED_LAUNCH(grouped_rows_product, tutel::cuda::plan_grouped_rows_product(c.rows, c.experts, c.outputs),
                        options, rows.data(), a.row_stride, weight.data(),
                        transposed ? TUTEL_COLUMNS_CONTIGUOUS : TUTEL_REDUCTION_CONTIGUOUS,
                        with_bias ? bias.data() : nullptr, ends.data(), c.rows, c.experts, c.depth, c.outputs,
                        out.data());
  return out.values();
}

struct Gradients {
  std::vector<storage_t> rows, weight, bias;
};

// What grouped_rows_linear_backward_cuda launches: the row gradient (the product kernel with the
// weight read the other way), then the weight and bias gradients in one kernel.
Gradients backward_on_cpu(const Operands& a, const Case& c, bool transposed, bool need_weight, bool need_bias,
                          const LaunchOptions& options) {
  DeviceBuffer<storage_t> rows(a.rows), weight(a.weight), grad(a.grad);
  DeviceBuffer<int> ends(a.ends);
  DeviceBuffer<storage_t> grad_rows(c.rows * c.depth), grad_weight(c.experts * c.outputs * c.depth),
      grad_bias(c.experts * c.outputs);
  TUTEL_EMULATED_LAUNCH(grouped_rows_product, tutel::cuda::plan_grouped_rows_product(c.rows, c.experts, c.depth),
                        options, grad.data(), c.outputs, weight.data(),
                        transposed ? TUTEL_REDUCTION_CONTIGUOUS : TUTEL_COLUMNS_CONTIGUOUS, nullptr, ends.data(),
                        c.rows, c.experts, c.outputs, c.depth, grad_rows.data());
  // F.linear layout: d W[e] = G_e^T X_e ([O, K]), d b from G; transposed: X_e^T G_e ([K, O]).
  const int bias_of = need_bias ? (transposed ? 2 : 1) : 0;
  const int64_t p_cols = transposed ? c.depth : c.outputs, q_cols = transposed ? c.outputs : c.depth;
  const storage_t* p = transposed ? rows.data() : grad.data();
  const storage_t* q = transposed ? grad.data() : rows.data();
  const int64_t p_stride = transposed ? a.row_stride : c.outputs, q_stride = transposed ? c.outputs : a.row_stride;
  const tutel::cuda::WeightGradPlan plan =
      tutel::cuda::plan_grouped_rows_weight_grad(c.experts, p_cols, q_cols, need_weight, bias_of);
  TUTEL_EMULATED_LAUNCH(grouped_rows_weight_grad, plan.grid, options, p, p_stride, q, q_stride, ends.data(), c.rows,
                        p_cols, q_cols, plan.col_tiles, int(need_weight), bias_of, grad_weight.data(),
                        grad_bias.data());
  return Gradients{grad_rows.values(), grad_weight.values(), grad_bias.values()};
}

class GroupedRowsGemmCu : public ::testing::TestWithParam<Case> {};

TEST_P(GroupedRowsGemmCu, ProductMatchesFloat64Loop) {
  const Case& c = GetParam();
  std::mt19937 rng(unsigned(c.rows * 7 + c.experts * 131 + c.depth * 17 + c.outputs));
  const Operands a = make_operands(c, rng);
  const Groups groups = groups_of(a.ends, c.rows);
  int case_index = 0;
  for (bool transposed : {false, true})
    for (bool with_bias : {false, true}) {
      if (!c.every_layout && (transposed || !with_bias)) continue;
      // The first launch under run-ahead (which exposes a missing barrier), the others in turn.
      const LaunchOptions options = schedule_for_case(case_index == 0 ? 3 : int(c.rows + c.experts) + case_index);
      ++case_index;
      const std::vector<storage_t> out = product_on_cpu(a, c, transposed, with_bias, options);
      for (int64_t e = 0; e < c.experts; ++e)
        for (int64_t i = groups.begin[e]; i < groups.end[e]; ++i)
          for (int64_t o = 0; o < c.outputs; ++o) {
            long double exact = with_bias ? value_of(a.bias[e * c.outputs + o]) : 0.0L;
            long double magnitude = std::fabs(exact);
            for (int64_t k = 0; k < c.depth; ++k) {
              const long double term = value_of(a.rows[i * a.row_stride + k]) * weight_at(a, c, transposed, e, o, k);
              exact += term;
              magnitude += std::fabs(term);
            }
            ASSERT_TRUE(sum_close(out[i * c.outputs + o], exact, magnitude, c.depth))
                << "row " << i << " (expert " << e << "), output " << o << ", transposed " << transposed
                << ", bias " << with_bias;
          }
      for (int64_t i = groups.kept(); i < c.rows; ++i)
        for (int64_t o = 0; o < c.outputs; ++o)
          ASSERT_EQ(value_of(out[i * c.outputs + o]), 0.0L) << "row " << i << " past the last end";
    }
}

TEST_P(GroupedRowsGemmCu, GradientsMatchFloat64Loop) {
  const Case& c = GetParam();
  std::mt19937 rng(unsigned(c.rows * 5 + c.experts * 11 + c.depth * 3 + c.outputs));
  const Operands a = make_operands(c, rng);
  const Groups groups = groups_of(a.ends, c.rows);
  int case_index = 0;
  for (bool transposed : {false, true})
    for (int needs : {3, 1, 2}) {  // weight and bias, weight only, bias only
      if (!c.every_layout && (transposed || needs != 3)) continue;
      const bool need_weight = needs & 1, need_bias = needs & 2;
      const LaunchOptions options = schedule_for_case(case_index == 0 ? 3 : int(c.depth + c.outputs) + case_index);
      ++case_index;
      const Gradients g = backward_on_cpu(a, c, transposed, need_weight, need_bias, options);
      for (int64_t e = 0; e < c.experts; ++e)
        for (int64_t i = groups.begin[e]; i < groups.end[e]; ++i)
          for (int64_t k = 0; k < c.depth; ++k) {
            long double exact = 0, magnitude = 0;
            for (int64_t o = 0; o < c.outputs; ++o) {
              const long double term = value_of(a.grad[i * c.outputs + o]) * weight_at(a, c, transposed, e, o, k);
              exact += term;
              magnitude += std::fabs(term);
            }
            ASSERT_TRUE(sum_close(g.rows[i * c.depth + k], exact, magnitude, c.outputs))
                << "d rows " << i << ", " << k << ", transposed " << transposed;
          }
      for (int64_t i = groups.kept(); i < c.rows; ++i)
        for (int64_t k = 0; k < c.depth; ++k)
          ASSERT_EQ(value_of(g.rows[i * c.depth + k]), 0.0L) << "d rows " << i << " past the last end";
      for (int64_t e = 0; e < c.experts; ++e)
        for (int64_t o = 0; o < c.outputs; ++o) {
          for (int64_t k = 0; k < c.depth && need_weight; ++k) {
            long double exact = 0, magnitude = 0;
            for (int64_t i = groups.begin[e]; i < groups.end[e]; ++i) {
              const long double term = value_of(a.grad[i * c.outputs + o]) * value_of(a.rows[i * a.row_stride + k]);
              exact += term;
              magnitude += std::fabs(term);
            }
            const int64_t at = transposed ? (e * c.depth + k) * c.outputs + o : (e * c.outputs + o) * c.depth + k;
            ASSERT_TRUE(sum_close(g.weight[at], exact, magnitude, groups.end[e] - groups.begin[e]))
                << "d weight of expert " << e << " at (" << o << ", " << k << "), transposed " << transposed;
          }
          if (!need_bias) continue;
          long double exact = 0, magnitude = 0;
          for (int64_t i = groups.begin[e]; i < groups.end[e]; ++i) {
            exact += value_of(a.grad[i * c.outputs + o]);
            magnitude += std::fabs(value_of(a.grad[i * c.outputs + o]));
          }
          ASSERT_TRUE(sum_close(g.bias[e * c.outputs + o], exact, magnitude, groups.end[e] - groups.begin[e]))
              << "d bias of expert " << e << " at " << o << ", transposed " << transposed;
        }
    }
}

// Rows per expert for `experts` experts over `kept` rows: random, some experts empty.
std::vector<int64_t> random_counts(int64_t experts, int64_t kept, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> counts(static_cast<size_t>(experts), 0);
  std::uniform_int_distribution<int64_t> pick(0, experts - 1);
  for (int64_t i = 0; i < kept; ++i) ++counts[pick(rng)];
  return counts;
}

Case make_case(int64_t rows, int64_t experts, int64_t depth, int64_t outputs, std::vector<int64_t> counts,
               int64_t row_padding = 0) {
  return Case{rows, experts, depth, outputs, std::move(counts), row_padding, {}, true};
}

std::vector<Case> cases() {
  std::vector<Case> all;
  all.push_back(make_case(0, 3, 5, 7, {0, 0, 0}));                       // no rows
  all.push_back(make_case(1, 1, 1, 1, {1}));                             // one of everything
  all.push_back(make_case(37, 5, 19, 23, {9, 0, 17, 0, 11}));            // odd sizes, empty experts
  all.push_back(make_case(150, 4, 33, 70, {0, 150, 0, 0}));              // all rows in one expert: 3 tiles
  all.push_back(make_case(100, 6, 24, 65, {13, 0, 40, 7, 0, 20}, 3));    // 20 rows past the last end, strided
  Case many = make_case(200, 300, 17, 9, random_counts(300, 190, 1));   // many experts, 2 per thread
  many.every_layout = false;  // 300 blocks per launch
  all.push_back(many);
  all.push_back(make_case(70, 8, 70, 5, random_counts(8, 70, 2)));       // several reduction steps
  all.push_back(make_case(5, 3, 0, 6, {2, 0, 3}));                       // no inputs: the bias alone
  all.push_back(make_case(66, 2, 3, 64, {65, 1}));                       // a tile boundary inside an expert
  Case bad = make_case(40, 5, 9, 11, {});                                // caller-made ends
  bad.ends_override = {12, 7, -3, 25, 90};                               // out of order, negative, past N
  all.push_back(bad);
  return all;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedRowsGemmCu, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return "N" + std::to_string(c.rows) + "_E" + std::to_string(c.experts) + "_K" +
                                  std::to_string(c.depth) + "_O" + std::to_string(c.outputs) + "_" +
                                  std::to_string(info.index);
                         });

}  // namespace
