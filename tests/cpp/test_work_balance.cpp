// Spreading pieces of work over workers: the claiming order, every item claimed once (also from
// several threads at a time), the greedy bound on real costs that differ from the estimates, and
// how many pieces a piece of work is cut into.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "core/work_balance.h"

using namespace tutel::core;

namespace {

std::vector<double> random_costs(std::mt19937& rng, int64_t items, double low, double high) {
  std::uniform_real_distribution<double> cost(low, high);
  std::vector<double> costs(items);
  for (double& c : costs) c = cost(rng);
  return costs;
}

// The time the last of `workers` finishes when each claims from `queue` whenever it is idle and
// item i really takes actual[i] (an event simulation: the worker that is free first claims next).
double makespan_claiming(WorkQueue& queue, const std::vector<double>& actual, int64_t workers) {
  std::vector<double> free_at(size_t(workers), 0.0);
  while (true) {
    const auto first_free = std::min_element(free_at.begin(), free_at.end());
    const int64_t item = queue.claim();
    if (item < 0) break;
    *first_free += actual[size_t(item)];
  }
  return *std::max_element(free_at.begin(), free_at.end());
}

}  // namespace

TEST(WorkBalance, LongestFirstOrdersByCostThenIndex) {
  EXPECT_EQ(longest_first({3, 5, 2, 4, 3}), (std::vector<int64_t>{1, 3, 0, 4, 2}));
  EXPECT_EQ(longest_first(std::vector<double>(4, 1.0)), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_TRUE(longest_first({}).empty());
}

TEST(WorkBalance, QueueHandsOutItsOrderOnceThenMinusOne) {
  WorkQueue queue({4, 0, 2});
  EXPECT_EQ(queue.claim(), 4);
  EXPECT_EQ(queue.claim(), 0);
  EXPECT_EQ(queue.claim(), 2);
  EXPECT_EQ(queue.claim(), -1);
  EXPECT_EQ(queue.claim(), -1);
  WorkQueue empty({});
  EXPECT_EQ(empty.claim(), -1);
}

TEST(WorkBalance, EveryItemClaimedExactlyOnceFromSeveralThreads) {
  constexpr int64_t kItems = 20000, kThreads = 4;
  std::vector<int64_t> order(kItems);
  std::iota(order.begin(), order.end(), int64_t(0));
  std::shuffle(order.begin(), order.end(), std::mt19937(5));
  WorkQueue queue(order);
  std::vector<std::vector<int64_t>> claimed(kThreads);
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int64_t item = queue.claim(); item >= 0; item = queue.claim()) claimed[size_t(t)].push_back(item);
    });
  for (std::thread& thread : threads) thread.join();
  std::vector<int64_t> seen;
  for (const auto& list : claimed) seen.insert(seen.end(), list.begin(), list.end());
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(kItems);
  std::iota(all.begin(), all.end(), int64_t(0));
  EXPECT_EQ(seen, all);
}

TEST(WorkBalance, RunsAreAShareOfWhatIsLeftAndCoverTheOrder) {
  // 2 workers: a quarter of what is left each time, at least one: 40 -> 10, 7, 5, 4, 3, 2, 2, 1 ...
  std::vector<int64_t> order(40);
  std::iota(order.begin(), order.end(), int64_t(100));
  WorkQueue queue(order);
  std::vector<int64_t> sizes, items;
  for (auto run = queue.claim_run(2); run.first < run.second; run = queue.claim_run(2)) {
    EXPECT_EQ(run.first, int64_t(items.size()));  // runs follow each other
    sizes.push_back(run.second - run.first);
    for (int64_t position = run.first; position < run.second; ++position) items.push_back(queue.at(position));
  }
  EXPECT_EQ(items, order);
  ASSERT_GE(sizes.size(), 4u);
  EXPECT_EQ((std::vector<int64_t>(sizes.begin(), sizes.begin() + 4)), (std::vector<int64_t>{10, 7, 5, 4}));
  EXPECT_EQ(sizes.back(), 1);
  EXPECT_EQ(queue.claim_run(2), (std::pair<int64_t, int64_t>{40, 40}));
  EXPECT_EQ(queue.claim(), -1);
  WorkQueue empty({});
  EXPECT_EQ(empty.claim_run(3), (std::pair<int64_t, int64_t>{0, 0}));
}

TEST(WorkBalance, RunsAndSingleClaimsFromSeveralThreadsCoverEveryItemOnce) {
  constexpr int64_t kItems = 20000, kThreads = 4;
  std::vector<int64_t> order(kItems);
  std::iota(order.begin(), order.end(), int64_t(0));
  std::shuffle(order.begin(), order.end(), std::mt19937(9));
  WorkQueue queue(order);
  std::vector<std::vector<int64_t>> claimed(kThreads);
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      while (true) {  // odd threads take single items, even ones runs
        if (t % 2) {
          const int64_t item = queue.claim();
          if (item < 0) return;
          claimed[size_t(t)].push_back(item);
        } else {
          const auto run = queue.claim_run(kThreads);
          if (run.first == run.second) return;
          for (int64_t position = run.first; position < run.second; ++position)
            claimed[size_t(t)].push_back(queue.at(position));
        }
      }
    });
  for (std::thread& thread : threads) thread.join();
  std::vector<int64_t> seen;
  for (const auto& list : claimed) seen.insert(seen.end(), list.begin(), list.end());
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(kItems);
  std::iota(all.begin(), all.end(), int64_t(0));
  EXPECT_EQ(seen, all);
}

TEST(WorkBalance, ClaimingStaysWithinTheGreedyBoundOnTheRealCosts) {
  // Greedy claiming ends by the mean real load plus (1 - 1/m) of the longest real item, whatever
  // the estimates said: here the real costs are the estimates times 0.5..2.
  std::mt19937 rng(13);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t workers = 2 + trial % 7, items = 1 + trial % 60;
    const std::vector<double> estimates = random_costs(rng, items, 1.0, 50.0);
    std::vector<double> actual = estimates;
    for (double& a : actual) a *= random_costs(rng, 1, 0.5, 2.0)[0];
    WorkQueue queue(longest_first(estimates));
    const double total = std::accumulate(actual.begin(), actual.end(), 0.0);
    const double longest = *std::max_element(actual.begin(), actual.end());
    EXPECT_LE(makespan_claiming(queue, actual, workers),
              total / double(workers) + (1.0 - 1.0 / double(workers)) * longest + 1e-9);
  }
}

TEST(WorkBalance, SlowItemsOfEqualEstimateAreShared) {
  // The grouped operator's backward: per expert an input gradient and a weight gradient of the same
  // estimated cost, the second really 1.45x slower.  Lists fixed from the estimates gave one of two
  // threads every weight gradient (8 x 1.45 = 11.6); claiming ends at half the total plus at most
  // one item.
  std::vector<double> estimates(16, 1.0), actual(16, 1.0);
  for (size_t i = 1; i < actual.size(); i += 2) actual[i] = 1.45;
  WorkQueue queue(longest_first(estimates));
  const double total = std::accumulate(actual.begin(), actual.end(), 0.0);  // 19.6
  EXPECT_LE(makespan_claiming(queue, actual, 2), total / 2 + 1.45 / 2 + 1e-9);
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
