// The one threading primitive the core uses.  It is declared here and defined
// by whoever links the core: the PyTorch extension forwards to at::parallel_for
// (so the core shares PyTorch's thread pool and honours torch.set_num_threads),
// and the C++ unit tests use plain std::threads.
#pragma once

#include <cstdint>
#include <functional>

namespace tutel {
namespace core {

// Calls fn(chunk_begin, chunk_end) over disjoint chunks covering [begin, end),
// possibly concurrently.  Chunks hold at least `grain` items unless the range is
// shorter.  fn must not throw.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

// Upper bound on the number of chunks parallel_for runs at once.
int max_parallelism();

// Splits [0, n) into at most `parts` contiguous, nearly equal pieces and runs
// fn(piece_index, piece_begin, piece_end) for each, in parallel.  Used by the
// two-pass scans, which need a fixed piece count to size their scratch tables.
void parallel_pieces(int64_t n, int64_t parts,
                     const std::function<void(int64_t, int64_t, int64_t)>& fn);

// Number of pieces worth using for n items when each piece should hold at least
// min_items_per_piece items.
int64_t useful_pieces(int64_t n, int64_t min_items_per_piece);

}  // namespace core
}  // namespace tutel
