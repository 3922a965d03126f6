// Spreading pieces of work over workers: the claiming order, every item claimed once (also from
// several threads at a time), the greedy bound on real costs that differ from the estimates, and
// how many pieces a piece of work is cut into.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "gemm/work_balance.h"

using namespace tutel::gemm;

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

std::vector<int64_t> zero_to(int64_t n) {
  std::vector<int64_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), int64_t(0));
  return all;
}

// Every item that `threads` threads claimed from one queue of a shuffled order of `items` items,
// sorted: thread t calls take(queue, t, its list) until it returns false.
template <class Take>
std::vector<int64_t> claimed_by_threads(int64_t items, int64_t threads, unsigned seed, Take take) {
  std::vector<int64_t> order = zero_to(items);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  WorkQueue queue(order);
  std::vector<std::vector<int64_t>> claimed(static_cast<size_t>(threads));
  std::vector<std::thread> workers;
  for (int64_t t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      while (take(queue, t, claimed[size_t(t)])) {
      }
    });
  for (std::thread& worker : workers) worker.join();
  std::vector<int64_t> seen;
  for (const auto& list : claimed) seen.insert(seen.end(), list.begin(), list.end());
  std::sort(seen.begin(), seen.end());
  return seen;
}

}  // namespace

TEST(WorkBalance, LongestFirstOrdersByCostThenIndex) {
  EXPECT_EQ(longest_first({3, 5, 2, 4, 3}), (std::vector<int64_t>{1, 3, 0, 4, 2}));
  EXPECT_EQ(longest_first(std::vector<double>(4, 1.0)), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_TRUE(longest_first({}).empty());
}

TEST(WorkBalance, GroupedItemsFollowTheirGroupsLongestFirst) {
  // Groups of 3 items; costs 2, 5, 2, 7: groups 3, 1, 0, 2, each group's items together.
  EXPECT_EQ(grouped_longest_first({2, 5, 2, 7}, 3),
            (std::vector<int64_t>{9, 10, 11, 3, 4, 5, 0, 1, 2, 6, 7, 8}));
  // The same order longest_first gives the items with their groups' costs.
  std::mt19937 rng(17);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t groups = 1 + trial % 9, per_group = 1 + trial % 5;
    std::vector<double> group_costs;
    for (int64_t g = 0; g < groups; ++g) group_costs.push_back(double(rng() % 4));  // ties on purpose
    std::vector<double> item_costs;
    for (int64_t item = 0; item < groups * per_group; ++item) item_costs.push_back(group_costs[size_t(item / per_group)]);
    EXPECT_EQ(grouped_longest_first(group_costs, per_group), longest_first(item_costs));
  }
  EXPECT_TRUE(grouped_longest_first({}, 4).empty());
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
  const auto seen = claimed_by_threads(20000, 4, 5, [](WorkQueue& queue, int64_t, std::vector<int64_t>& mine) {
    const int64_t item = queue.claim();
    if (item >= 0) mine.push_back(item);
    return item >= 0;
  });
  EXPECT_EQ(seen, zero_to(20000));
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
  // Odd threads take single items, even ones runs.
  const auto seen = claimed_by_threads(20000, 4, 9, [](WorkQueue& queue, int64_t t, std::vector<int64_t>& mine) {
    if (t % 2) {
      const int64_t item = queue.claim();
      if (item >= 0) mine.push_back(item);
      return item >= 0;
    }
    const auto run = queue.claim_run(4);
    for (int64_t position = run.first; position < run.second; ++position) mine.push_back(queue.at(position));
    return run.first < run.second;
  });
  EXPECT_EQ(seen, zero_to(20000));
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
