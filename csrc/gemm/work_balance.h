// Spreading independent pieces of work of estimated cost over the threads.
// Used where each piece runs best on one thread (a whole matrix product of one
// expert): for the 64..512-row products of an MoE layer a single-threaded GEMM
// per worker outruns one GEMM split across the threads, which synchronises
// inside every product and shares each packed panel.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace tutel {
namespace gemm {

// How many nearly equal pieces to cut a piece of work into: enough that no piece
// costs more than `max_cost`, but none shorter than `min_extent` along the
// dimension being cut (`extent` long).  Always at least 1.
int64_t pieces_to_cut(double cost, double max_cost, int64_t extent, int64_t min_extent);

// Work items in the order workers should claim them: the largest cost first, equal costs in index
// order.
std::vector<int64_t> longest_first(const std::vector<double>& costs);

// The items of groups of `per_group` items each (group g's items g * per_group .. + per_group - 1,
// all of one cost), in the order longest_first gives them: the groups by `group_costs`, largest
// first, equal costs in index order, each group's items together in index order.
std::vector<int64_t> grouped_longest_first(const std::vector<double>& group_costs, int64_t per_group);

// Hands out the items of an order, one at a time or in runs, to whichever worker asks next.  The
// costs are estimates (multiply-adds), and products of equal cost run at different rates (PyTorch's
// bfloat16 GEMM is markedly slower for a weight gradient, whose left operand is a transposed view,
// than for the input gradient of the same shape): a worker that claims as it finishes ends at most
// one item after the others whatever the real costs, where lists fixed in advance left one thread
// with every slow item (docs/performance.md, "Large groups: work balance").
class WorkQueue {
 public:
  explicit WorkQueue(std::vector<int64_t> order) : order_(std::move(order)) {}

  // The next item of the order, or -1 once every item is claimed.  Safe from several threads.
  int64_t claim() {
    const int64_t position = next_.fetch_add(1, std::memory_order_relaxed);
    return position < int64_t(order_.size()) ? order_[size_t(position)] : -1;
  }

  // A run of neighbouring positions of the order, [first, last), claimed together: 1 / (2 workers)
  // of the items left, at least one (first == last once every item is claimed).  For small items
  // of neighbouring memory (a matrix's outputs in pieces): each worker streams long runs first,
  // where claiming items one at a time had the workers take turns along the same matrix and
  // stream it worse, and the last claims are single items.
  // Safe from several threads, also beside claim().
  std::pair<int64_t, int64_t> claim_run(int64_t workers) {
    const int64_t size = int64_t(order_.size());
    int64_t first = next_.load(std::memory_order_relaxed);
    while (first < size) {
      const int64_t take = std::max<int64_t>(1, (size - first) / (2 * std::max<int64_t>(1, workers)));
      if (next_.compare_exchange_weak(first, first + take, std::memory_order_relaxed)) return {first, first + take};
    }
    return {size, size};
  }

  // The item at `position` of the order.
  int64_t at(int64_t position) const { return order_[size_t(position)]; }

 private:
  const std::vector<int64_t> order_;
  std::atomic<int64_t> next_{0};
};

}  // namespace gemm
}  // namespace tutel
