// A queue of work items that whichever worker asks next claims, one at a time or in runs: the
// dynamic balance of the grouped products (gemm/) and of the quantized decode passes.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace tutel {
namespace core {

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

}  // namespace core
}  // namespace tutel
