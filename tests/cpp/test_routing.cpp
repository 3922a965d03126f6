// select_topk, priority_order and assign_locations against brute-force loops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <ostream>
#include <random>
#include <vector>

#include "core/routing.h"

using namespace tutel::core;

namespace {

// Scores with frequent ties (values drawn from a small set) when `ties`.
std::vector<float> random_scores(int64_t tokens, int64_t experts, bool ties, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(0.f, 1.f);
  std::vector<float> scores(tokens * experts);
  for (auto& s : scores) s = ties ? std::floor(dist(rng) * 4) / 4 : dist(rng);
  return scores;
}

bool above(float a, float b) { return std::isnan(a) ? !std::isnan(b) : a > b; }

std::vector<int32_t> brute_topk(const std::vector<float>& scores, int64_t tokens, int64_t experts, int64_t k) {
  std::vector<int32_t> out(k * tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> ids(experts);
    std::iota(ids.begin(), ids.end(), 0);
    const float* row = scores.data() + t * experts;
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return above(row[a], row[b]); });
    for (int64_t j = 0; j < k; ++j) out[j * tokens + t] = ids[j];
  }
  return out;
}

// The GShard rule written as the obvious nested loop with one counter per expert.
void brute_locations(const std::vector<int32_t>& indices, int64_t tokens, int64_t k, int64_t experts,
                     const std::vector<int32_t>& order, std::vector<int32_t>& locations,
                     std::vector<int32_t>& counts) {
  std::vector<int32_t> next(experts, 0);
  locations.assign(k * tokens, -1);
  counts.assign(k * experts, 0);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t pos = 0; pos < tokens; ++pos) {
      int64_t t = order.empty() ? pos : order[pos];
      int32_t e = indices[j * tokens + t];
      locations[j * tokens + t] = next[e]++;
      counts[j * experts + e]++;
    }
}

struct Shape {
  int64_t tokens, experts, k;
};

// Names the case in test output ("T=37 E=7 k=2") instead of dumping its bytes.
void PrintTo(const Shape& s, std::ostream* out) {
  *out << "T=" << s.tokens << " E=" << s.experts << " k=" << s.k;
}

}  // namespace

class RoutingShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(RoutingShapes, MatchesBruteForce) {
  const Shape s = GetParam();
  for (bool ties : {false, true}) {
    auto scores = random_scores(s.tokens, s.experts, ties, unsigned(s.tokens * 31 + s.experts * 7 + s.k));
    std::vector<int32_t> indices(s.k * s.tokens);
    std::vector<float> gates(s.k * s.tokens);
    select_topk(scores.data(), s.tokens, s.experts, s.k, indices.data(), gates.data());
    ASSERT_EQ(indices, brute_topk(scores, s.tokens, s.experts, s.k));
    for (int64_t j = 0; j < s.k; ++j)
      for (int64_t t = 0; t < s.tokens; ++t)
        ASSERT_EQ(gates[j * s.tokens + t], scores[t * s.experts + indices[j * s.tokens + t]]);

    for (bool prioritized : {false, true}) {
      std::vector<int32_t> order;
      if (prioritized) {
        order.resize(s.tokens);
        priority_order(gates.data(), s.tokens, order.data());
        std::vector<int32_t> expected(s.tokens);
        std::iota(expected.begin(), expected.end(), 0);
        std::stable_sort(expected.begin(), expected.end(),
                         [&](int32_t a, int32_t b) { return gates[a] > gates[b]; });
        ASSERT_EQ(order, expected);
      }
      std::vector<int32_t> locations(s.k * s.tokens), counts(s.k * s.experts);
      Status status = assign_locations(indices.data(), s.tokens, s.k, s.experts,
                                       order.empty() ? nullptr : order.data(), locations.data(), counts.data());
      ASSERT_TRUE(status.ok());
      std::vector<int32_t> want_locations, want_counts;
      brute_locations(indices, s.tokens, s.k, s.experts, order, want_locations, want_counts);
      ASSERT_EQ(locations, want_locations);
      ASSERT_EQ(counts, want_counts);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Core, RoutingShapes,
                         ::testing::Values(Shape{0, 4, 1}, Shape{1, 1, 1}, Shape{1, 5, 5}, Shape{37, 7, 2},
                                           Shape{37, 3, 3}, Shape{4097, 8, 2}, Shape{4097, 64, 4},
                                           Shape{9000, 2, 1}, Shape{513, 130, 40}, Shape{200, 128, 128}));

TEST(Routing, NaNRanksFirstLikeTorchTopk) {
  std::vector<float> scores = {0.5f, NAN, 0.9f, 0.1f};
  std::vector<int32_t> indices(2);
  std::vector<float> gates(2);
  select_topk(scores.data(), 1, 4, 2, indices.data(), gates.data());
  EXPECT_EQ(indices[0], 1);
  EXPECT_EQ(indices[1], 2);
}

TEST(Routing, AllTokensToOneExpert) {
  const int64_t tokens = 1000, experts = 6;
  std::vector<float> scores(tokens * experts, 0.f);
  for (int64_t t = 0; t < tokens; ++t) scores[t * experts + 3] = 1.f;
  std::vector<int32_t> indices(tokens), locations(tokens), counts(experts);
  std::vector<float> gates(tokens);
  select_topk(scores.data(), tokens, experts, 1, indices.data(), gates.data());
  ASSERT_TRUE(assign_locations(indices.data(), tokens, 1, experts, nullptr, locations.data(), counts.data()).ok());
  for (int64_t t = 0; t < tokens; ++t) {
    ASSERT_EQ(indices[t], 3);
    ASSERT_EQ(locations[t], t);
  }
  EXPECT_EQ(counts[3], tokens);
}

TEST(Routing, ReportsTheFirstOutOfRangeIndex) {
  const int64_t tokens = 10000, experts = 4;
  std::vector<int32_t> indices(2 * tokens, 1), locations(2 * tokens), counts(2 * experts);
  indices[tokens + 9000] = 7;   // choice 1
  indices[5000] = -2;           // choice 0: reported first
  Status status = assign_locations(indices.data(), tokens, 2, experts, nullptr, locations.data(), counts.data());
  EXPECT_EQ(status.code, StatusCode::kExpertIndexOutOfRange);
  EXPECT_EQ(status.choice, 0);
  EXPECT_EQ(status.token, 5000);
  EXPECT_EQ(status.value, -2);
}

// priority_order against std::stable_sort by the ranking select_topk uses, with
// ties, NaN, infinities and both zeros, on sizes that split into several pieces.
template <class T>
void check_priority_order(int64_t tokens, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> pick(0, 19);
  std::uniform_real_distribution<double> dist(-2.0, 2.0);
  std::vector<T> priority(tokens);
  for (auto& value : priority) {
    double v = dist(rng);
    switch (pick(rng)) {
      case 0: v = NAN; break;
      case 1: v = -NAN; break;
      case 2: v = INFINITY; break;
      case 3: v = -INFINITY; break;
      case 4: v = 0.0; break;
      case 5: v = -0.0; break;
      case 6: case 7: v = std::floor(v * 4) / 4; break;  // frequent ties
      default: break;
    }
    value = Scalar<T>::store(static_cast<acc_t<T>>(v));
  }
  std::vector<int32_t> order(tokens), expected(tokens);
  priority_order(priority.data(), tokens, order.data());
  std::iota(expected.begin(), expected.end(), 0);
  std::stable_sort(expected.begin(), expected.end(), [&](int32_t a, int32_t b) {
    acc_t<T> x = Scalar<T>::load(priority[a]), y = Scalar<T>::load(priority[b]);
    return std::isnan(x) ? !std::isnan(y) : x > y;
  });
  ASSERT_EQ(order, expected) << "tokens " << tokens;
}

TEST(Routing, PriorityOrderIsAStableDescendingSort) {
  for (int64_t tokens : {0, 1, 2, 7, 1000, 70000}) {
    check_priority_order<float>(tokens, unsigned(tokens + 1));
    check_priority_order<double>(tokens, unsigned(tokens + 2));
    check_priority_order<bfloat16>(tokens, unsigned(tokens + 3));
    check_priority_order<float16>(tokens, unsigned(tokens + 4));
  }
}
