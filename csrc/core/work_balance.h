// Spreading independent pieces of work of known cost over a fixed number of
// workers.  Used where each piece runs best on one thread (a whole matrix
// product of one expert): for the 64..512-row products of an MoE layer a
// single-threaded GEMM per worker outruns one GEMM split across the threads,
// which synchronises inside every product and shares each packed panel.
#pragma once

#include <cstdint>
#include <vector>

namespace tutel {
namespace core {

// How many nearly equal pieces to cut a piece of work into: enough that no piece
// costs more than `max_cost`, but none shorter than `min_extent` along the
// dimension being cut (`extent` long).  Always at least 1.
int64_t pieces_to_cut(double cost, double max_cost, int64_t extent, int64_t min_extent);

// Assigns work items to `workers` lists, largest cost first onto the least-loaded
// worker (longest-processing-time rule: the busiest worker ends within 4/3 of the
// best possible).  Returns, for each worker, the indices of its items in the order
// it runs them.  Ties go to the lower index, so the result is deterministic.
std::vector<std::vector<int64_t>> balance_work(const std::vector<double>& costs, int64_t workers);

}  // namespace core
}  // namespace tutel
