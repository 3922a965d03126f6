// gather_slots / scatter_slots against brute-force loops in double precision.
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <random>
#include <vector>

#include "core/dispatch.h"
#include "core/routing.h"

using namespace tutel::core;

namespace {

struct Case {
  int64_t tokens, experts, k, capacity, M;
};

// Names the case in test output instead of dumping its bytes.
void PrintTo(const Case& c, std::ostream* out) {
  *out << "T=" << c.tokens << " E=" << c.experts << " k=" << c.k << " C=" << c.capacity << " M=" << c.M;
}

struct Routing {
  std::vector<int32_t> indices, locations;
  std::vector<double> weights;
};

// Distinct experts per token (as top-k gives) with GShard locations.
Routing make_routing(const Case& c, std::mt19937& rng) {
  Routing r;
  std::vector<float> scores(c.tokens * c.experts);
  std::uniform_real_distribution<float> dist(0.f, 1.f);
  for (auto& s : scores) s = dist(rng);
  r.indices.resize(c.k * c.tokens);
  r.locations.resize(c.k * c.tokens);
  std::vector<float> gates(c.k * c.tokens);
  std::vector<int32_t> counts(c.k * c.experts);
  select_topk(scores.data(), c.tokens, c.experts, c.k, r.indices.data(), gates.data());
  EXPECT_TRUE(assign_locations(r.indices.data(), c.tokens, c.k, c.experts, nullptr, r.locations.data(),
                               counts.data()).ok());
  r.weights.resize(c.k * c.tokens);
  for (auto& w : r.weights) w = dist(rng) * 2 - 0.5;
  return r;
}

std::vector<double> random_rows(int64_t n, std::mt19937& rng) {
  std::normal_distribution<double> dist;
  std::vector<double> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

SlotTable table_of(const Routing& r, const Case& c) {
  return SlotTable{r.indices.data(), r.locations.data(), c.k, c.tokens, c.experts, c.capacity};
}

}  // namespace

class DispatchCases : public ::testing::TestWithParam<Case> {};

TEST_P(DispatchCases, GatherMatchesBruteForce) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(c.tokens + 13 * c.experts + 101 * c.k + c.capacity));
  Routing r = make_routing(c, rng);
  auto rows = random_rows(c.experts * c.capacity * c.M, rng);
  auto other = random_rows(c.tokens * c.M, rng);
  for (bool weighted : {false, true}) {
    std::vector<double> out(c.tokens * c.M, 1e300), dots(c.k * c.tokens, 1e300);
    ASSERT_TRUE(gather_slots(rows.data(), c.M, table_of(r, c), weighted ? contiguous_weights(r.weights.data(), c.tokens) : ChoiceWeights{},
                             other.data(), dots.data(), out.data()).ok());
    for (int64_t t = 0; t < c.tokens; ++t) {
      std::vector<double> want(c.M, 0.0);
      for (int64_t j = 0; j < c.k; ++j) {
        int64_t e = r.indices[j * c.tokens + t], l = r.locations[j * c.tokens + t];
        double w = weighted ? r.weights[j * c.tokens + t] : 1.0, dot = 0.0;
        if (l < c.capacity)
          for (int64_t m = 0; m < c.M; ++m) {
            want[m] += w * rows[(e * c.capacity + l) * c.M + m];
            dot += rows[(e * c.capacity + l) * c.M + m] * other[t * c.M + m];
          }
        ASSERT_NEAR(dots[j * c.tokens + t], dot, 1e-9);
      }
      for (int64_t m = 0; m < c.M; ++m) ASSERT_NEAR(out[t * c.M + m], want[m], 1e-12);
    }
  }
}

TEST_P(DispatchCases, ScatterMatchesBruteForce) {
  const Case c = GetParam();
  std::mt19937 rng(unsigned(7 * c.tokens + c.experts + c.k + 3 * c.capacity));
  Routing r = make_routing(c, rng);
  auto src = random_rows(c.tokens * c.M, rng);
  auto other = random_rows(c.experts * c.capacity * c.M, rng);
  for (bool weighted : {false, true}) {
    std::vector<double> out(c.experts * c.capacity * c.M, 1e300), dots(c.k * c.tokens, 1e300);
    ASSERT_TRUE(scatter_slots(src.data(), c.M, table_of(r, c), weighted ? contiguous_weights(r.weights.data(), c.tokens) : ChoiceWeights{},
                              other.data(), dots.data(), out.data()).ok());
    std::vector<double> want(out.size(), 0.0);
    for (int64_t j = 0; j < c.k; ++j)
      for (int64_t t = 0; t < c.tokens; ++t) {
        int64_t e = r.indices[j * c.tokens + t], l = r.locations[j * c.tokens + t];
        double w = weighted ? r.weights[j * c.tokens + t] : 1.0, dot = 0.0;
        if (l < c.capacity)
          for (int64_t m = 0; m < c.M; ++m) {
            want[(e * c.capacity + l) * c.M + m] += w * src[t * c.M + m];
            dot += other[(e * c.capacity + l) * c.M + m] * src[t * c.M + m];
          }
        ASSERT_NEAR(dots[j * c.tokens + t], dot, 1e-9);
      }
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 1e-12) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Core, DispatchCases,
                         ::testing::Values(Case{0, 3, 1, 4, 5}, Case{1, 1, 1, 1, 1}, Case{37, 5, 2, 9, 7},
                                           Case{37, 5, 2, 0, 8}, Case{37, 4, 4, 40, 3},
                                           Case{200, 8, 2, 30, 16}, Case{4097, 16, 3, 500, 9},
                                           Case{300, 64, 1, 2, 33}));

TEST(Dispatch, SharedSlotsAreSummed) {
  // Two tokens claim slot (0, 0); the result is their sum, not either one.
  const int64_t M = 3;
  std::vector<int32_t> indices = {0, 0, 1}, locations = {0, 0, 0};
  std::vector<float> src = {1, 2, 3, 10, 20, 30, 5, 5, 5}, out(2 * 1 * M, -1.f);
  SlotTable table{indices.data(), locations.data(), 1, 3, 2, 1};
  ASSERT_TRUE(scatter_slots<float>(src.data(), M, table, {}, nullptr, nullptr, out.data()).ok());
  EXPECT_EQ(out, (std::vector<float>{11, 22, 33, 5, 5, 5}));
}

TEST(Dispatch, RejectsBadSlots) {
  std::vector<int32_t> indices = {0, 5}, locations = {0, 0};
  std::vector<float> rows(2 * 2 * 1, 1.f), out(2, 0.f);
  SlotTable table{indices.data(), locations.data(), 1, 2, 2, 2};
  Status s = gather_slots<float>(rows.data(), 1, table, {}, nullptr, nullptr, out.data());
  EXPECT_EQ(s.code, StatusCode::kExpertIndexOutOfRange);
  EXPECT_EQ(s.token, 1);
  indices = {0, 1};
  locations = {0, -3};
  s = scatter_slots<float>(out.data(), 1, table, {}, nullptr, nullptr, rows.data());
  EXPECT_EQ(s.code, StatusCode::kNegativeLocation);
  EXPECT_EQ(s.value, -3);
}

TEST(Dispatch, Bfloat16AccumulatesInFloat) {
  // k = 3 contributions summed in float, rounded once.
  const int64_t M = 4, tokens = 1, experts = 3, capacity = 1;
  std::vector<int32_t> indices = {0, 1, 2}, locations = {0, 0, 0};
  std::vector<bfloat16> rows(experts * capacity * M), out(M);
  float values[3] = {1.0f, 1.0f / 256, 1.0f / 256};  // 1 + 2/256: representable only if summed first
  for (int e = 0; e < 3; ++e)
    for (int m = 0; m < M; ++m) rows[e * M + m] = float_to_bf16(values[e]);
  SlotTable table{indices.data(), locations.data(), 3, tokens, experts, capacity};
  ASSERT_TRUE(gather_slots<bfloat16>(rows.data(), M, table, {}, nullptr, nullptr, out.data()).ok());
  for (int m = 0; m < M; ++m) EXPECT_EQ(bf16_to_float(out[m]), 1.0f + 2.0f / 256);
}

TEST(Dispatch, GroupedLayoutAndStridedWeights) {
  // No indices: every choice names expert 0.  The weights are a [T, k] bfloat16 table read as
  // [k, T] through strides; 1 + 1/128 is exact in bfloat16 and comes through unrounded.
  const int64_t M = 2, tokens = 2, k = 2, capacity = 4;
  std::vector<int32_t> zeros(k * tokens, 0), locations = {2, 0, 4, 1};  // choice 1 of token 0 dropped
  std::vector<bfloat16> weights = {float_to_bf16(1.0f + 1.0f / 128), float_to_bf16(3.0f),
                                   float_to_bf16(-2.0f), float_to_bf16(0.5f)};  // [t][j]
  const ChoiceWeights strided{weights.data(), WeightType::kBFloat16, 1, k};
  std::vector<float> src = {1, 2, 10, 20}, out(2 * capacity * M, -1.f), with_zeros(out);
  SlotTable grouped{nullptr, locations.data(), k, tokens, 2, capacity};
  ASSERT_TRUE(scatter_slots<float>(src.data(), M, grouped, strided, nullptr, nullptr, out.data()).ok());
  EXPECT_EQ(out, (std::vector<float>{-20, -40, 5, 10, 1 + 1.0f / 128, 2 + 2.0f / 128, 0, 0,  // expert 0
                                     0, 0, 0, 0, 0, 0, 0, 0}));                                // expert 1
  SlotTable explicit_zeros{zeros.data(), locations.data(), k, tokens, 2, capacity};
  ASSERT_TRUE(scatter_slots<float>(src.data(), M, explicit_zeros, strided, nullptr, nullptr, with_zeros.data()).ok());
  EXPECT_EQ(out, with_zeros);
  std::vector<float> back(tokens * M, -1.f);
  ASSERT_TRUE(gather_slots<float>(out.data(), M, grouped, {}, nullptr, nullptr, back.data()).ok());
  EXPECT_EQ(back, (std::vector<float>{1 + 1.0f / 128, 2 + 2.0f / 128, -15, -30}));
}
