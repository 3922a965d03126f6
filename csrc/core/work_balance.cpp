#include "work_balance.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace tutel {
namespace core {

int64_t pieces_to_cut(double cost, double max_cost, int64_t extent, int64_t min_extent) {
  if (!(cost > max_cost) || max_cost <= 0) return 1;
  const int64_t by_cost = static_cast<int64_t>(std::ceil(cost / max_cost));
  const int64_t by_extent = std::max<int64_t>(1, extent / std::max<int64_t>(1, min_extent));
  return std::max<int64_t>(1, std::min(by_cost, by_extent));
}

std::vector<std::vector<int64_t>> balance_work(const std::vector<double>& costs, int64_t workers) {
  workers = std::max<int64_t>(1, workers);
  std::vector<std::vector<int64_t>> lists(workers);
  std::vector<int64_t> order(costs.size());
  std::iota(order.begin(), order.end(), int64_t(0));
  // Stable: equal costs keep their index order.
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::vector<double> load(workers, 0.0);
  for (int64_t item : order) {
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    lists[least].push_back(item);
    load[least] += costs[item];
  }
  return lists;
}

}  // namespace core
}  // namespace tutel
