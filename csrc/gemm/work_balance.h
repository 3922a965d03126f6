// Spreading independent pieces of work of estimated cost over the threads.
// Used where each piece runs best on one thread (a whole matrix product of one
// expert): for the 64..512-row products of an MoE layer a single-threaded GEMM
// per worker outruns one GEMM split across the threads, which synchronises
// inside every product and shares each packed panel.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../core/work_queue.h"

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

// The queue the workers claim the items from (core/work_queue.h).
using core::WorkQueue;

}  // namespace gemm
}  // namespace tutel
