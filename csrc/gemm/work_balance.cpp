#include "work_balance.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace tutel {
namespace gemm {

int64_t pieces_to_cut(double cost, double max_cost, int64_t extent, int64_t min_extent) {
  if (!(cost > max_cost) || max_cost <= 0) return 1;
  const int64_t by_cost = static_cast<int64_t>(std::ceil(cost / max_cost));
  const int64_t by_extent = std::max<int64_t>(1, extent / std::max<int64_t>(1, min_extent));
  return std::max<int64_t>(1, std::min(by_cost, by_extent));
}

std::vector<int64_t> longest_first(const std::vector<double>& costs) {
  std::vector<int64_t> order(costs.size());
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  return order;
}

std::vector<int64_t> grouped_longest_first(const std::vector<double>& group_costs, int64_t per_group) {
  std::vector<int64_t> items;
  items.reserve(group_costs.size() * size_t(std::max<int64_t>(0, per_group)));
  for (int64_t group : longest_first(group_costs))
    for (int64_t i = 0; i < per_group; ++i) items.push_back(group * per_group + i);
  return items;
}

}  // namespace gemm
}  // namespace tutel
