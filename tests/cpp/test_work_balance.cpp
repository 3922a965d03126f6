// Spreading pieces of work over workers: every item once, the longest-first
// bound, determinism, and how many pieces a piece of work is cut into.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/work_balance.h"

using namespace tutel::core;

namespace {

std::vector<double> loads_of(const std::vector<std::vector<int64_t>>& lists, const std::vector<double>& costs) {
  std::vector<double> loads;
  for (const auto& list : lists) {
    double load = 0;
    for (int64_t item : list) load += costs[item];
    loads.push_back(load);
  }
  return loads;
}

std::vector<double> random_costs(std::mt19937& rng, int64_t items) {
  std::uniform_real_distribution<double> cost(1.0, 50.0);
  std::vector<double> costs(items);
  for (double& c : costs) c = cost(rng);
  return costs;
}

// The load of the busiest worker when `costs` are spread by balance_work.
double busiest_load(const std::vector<double>& costs, int64_t workers) {
  const std::vector<double> loads = loads_of(balance_work(costs, workers), costs);
  return *std::max_element(loads.begin(), loads.end());
}

}  // namespace

TEST(WorkBalance, EveryItemGoesToExactlyOneWorker) {
  std::mt19937 rng(7);
  for (int64_t items : {0, 1, 2, 5, 64, 97}) {
    for (int64_t workers : {1, 2, 3, 16}) {
      const std::vector<double> costs = random_costs(rng, items);
      const auto lists = balance_work(costs, workers);
      ASSERT_EQ(int64_t(lists.size()), workers);
      std::vector<int64_t> seen;
      for (const auto& list : lists) seen.insert(seen.end(), list.begin(), list.end());
      std::sort(seen.begin(), seen.end());
      std::vector<int64_t> all(items);
      std::iota(all.begin(), all.end(), int64_t(0));
      EXPECT_EQ(seen, all) << items << " items on " << workers << " workers";
    }
  }
}

// The best makespan, by trying every assignment (small instances only).
static double best_makespan(const std::vector<double>& costs, int64_t workers) {
  double best = std::numeric_limits<double>::infinity();
  std::vector<int64_t> owner(costs.size(), 0);
  while (true) {
    std::vector<double> loads(workers, 0.0);
    for (size_t i = 0; i < costs.size(); ++i) loads[owner[i]] += costs[i];
    best = std::min(best, *std::max_element(loads.begin(), loads.end()));
    size_t digit = 0;
    while (digit < owner.size() && ++owner[digit] == workers) owner[digit++] = 0;
    if (digit == owner.size()) return best;
  }
}

TEST(WorkBalance, BusiestWorkerWithinTheLongestFirstBound) {
  // Longest-first ends within (4/3 - 1/(3m)) of the best assignment (Graham 1969).
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t workers = 2 + trial % 2;
    const std::vector<double> costs = random_costs(rng, 1 + trial % 9);
    EXPECT_LE(busiest_load(costs, workers),
              best_makespan(costs, workers) * (4.0 / 3.0 - 1.0 / (3.0 * double(workers))) + 1e-9);
  }
}

TEST(WorkBalance, BusiestWorkerWithinTheListSchedulingBound) {
  // Any greedy list: at most the mean load plus (1 - 1/m) of the largest item.
  std::mt19937 rng(13);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t workers = 2 + trial % 15;
    const std::vector<double> costs = random_costs(rng, 1 + trial % 80);
    const double total = std::accumulate(costs.begin(), costs.end(), 0.0);
    const double largest = *std::max_element(costs.begin(), costs.end());
    EXPECT_LE(busiest_load(costs, workers), total / double(workers) + (1.0 - 1.0 / double(workers)) * largest + 1e-9);
  }
}

TEST(WorkBalance, LargestItemsFirstOntoTheLeastLoadedWorker) {
  // costs 5, 4, 3, 3, 2 on two workers: 5 -> w0, 4 -> w1, 3 -> w1 (7), 3 -> w0 (8), 2 -> w1 (9).
  const auto lists = balance_work({3, 5, 2, 4, 3}, 2);
  EXPECT_EQ(lists[0], (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(lists[1], (std::vector<int64_t>{3, 0, 2}));
}

TEST(WorkBalance, EqualCostsKeepTheirOrderAndSpreadEvenly) {
  const auto lists = balance_work(std::vector<double>(6, 1.0), 3);
  EXPECT_EQ(lists[0], (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(lists[1], (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(lists[2], (std::vector<int64_t>{2, 5}));
}

TEST(WorkBalance, NonPositiveWorkerCountMeansOneWorker) {
  const auto lists = balance_work({1, 2, 3}, 0);
  ASSERT_EQ(lists.size(), 1u);
  EXPECT_EQ(lists[0], (std::vector<int64_t>{2, 1, 0}));
}

TEST(PiecesToCut, WholeWhenWithinTheLimit) {
  EXPECT_EQ(pieces_to_cut(100, 100, 1000, 64), 1);
  EXPECT_EQ(pieces_to_cut(0, 100, 1000, 64), 1);
  EXPECT_EQ(pieces_to_cut(100, 0, 1000, 64), 1);  // no limit to hold
}

TEST(PiecesToCut, EnoughPiecesToStayUnderTheLimit) {
  EXPECT_EQ(pieces_to_cut(101, 100, 1000, 64), 2);
  EXPECT_EQ(pieces_to_cut(800, 100, 1000, 64), 8);
  EXPECT_EQ(pieces_to_cut(801, 100, 1000, 64), 9);
}

TEST(PiecesToCut, NoPieceShorterThanTheMinimumExtent) {
  EXPECT_EQ(pieces_to_cut(800, 100, 300, 64), 4);   // 300 / 64 = 4 pieces of 75
  EXPECT_EQ(pieces_to_cut(800, 100, 127, 64), 1);   // two pieces would be shorter than 64
  EXPECT_EQ(pieces_to_cut(800, 100, 128, 64), 2);
  EXPECT_EQ(pieces_to_cut(800, 100, 5, 0), 5);      // a zero minimum means one row
}
