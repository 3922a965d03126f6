// How tutel's CUDA operators launch their kernels: which variant of a kernel
// source, the grid, the chunk sizes and the scratch tables, for given problem
// sizes.  Plain C++ with no CUDA or framework dependency, so that the
// operators (csrc/ops/cuda) and the CPU execution of the kernels
// (tests/cpp/kernels_on_cpu) make exactly the same launches.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "../../kernels/kernel_abi.h"

namespace tutel {
namespace cuda {

// Every launch uses blocks of TUTEL_BLOCK_THREADS threads along x.
struct Grid {
  int64_t x = 1;
  int64_t y = 1;
};

// Blocks needed for `items` items at `per_block` items per block.
inline int64_t blocks_for(int64_t items, int64_t per_block) {
  return (items + per_block - 1) / per_block;
}

// A grid with no block: the launch is skipped (nothing to do).
inline bool grid_is_empty(Grid grid) { return grid.x <= 0 || grid.y <= 0; }

// Whether CUDA can launch the (non-empty) grid: x < 2^31, y <= 65535.
bool grid_fits(Grid grid);

// The variants a kernel source is compiled in (its `// variants:` line).
enum class Variant : int {
  kNone,
  kFloat32, kFloat64, kFloat16, kBFloat16,  // routing and dispatch data
  kMaskBool, kMaskUint8, kMaskInt8, kMaskInt16, kMaskInt32, kMaskInt64, kMaskFloat32, kMaskFloat64,
  kCount
};

// The -D name that selects `variant` ("" for kNone), e.g. "TUTEL_DTYPE_FLOAT16".
const char* variant_define(Variant variant);

// ------------------------------------------------------------ cumsum.cu --
// cumsum_chunk_totals, cumsum_chunk_offsets, cumsum_chunk_scan in that order,
// with a scratch table totals[chunks, cols].  For rows, cols >= 1.
struct CumsumPlan {
  int64_t chunk_rows = 0;
  int64_t chunks = 0;
  Grid chunk_grid;    // totals and scan: (column blocks, chunks)
  Grid offsets_grid;  // offsets: one warp per column
};
CumsumPlan plan_cumsum(int64_t rows, int64_t cols);

// ---------------------------------------- routing_topk.cu, slot_assignment.cu --
// Slot assignment cuts the (ordered) tokens into chunks and works on a table
// [chunks, k, experts] of ints filled by route_topk or count_choices, then
// scanned by scan_choice_counts and consumed by assign_slots.
struct SlotAssignmentPlan {
  int64_t chunk_tokens = 0;
  int64_t chunks = 0;
  int64_t table_ints = 0;  // chunks * k * experts
  Grid chunk_grid;         // route_topk and count_choices: one block per chunk
  Grid scan_grid;          // scan_choice_counts: one warp per expert
  Grid assign_grid;        // assign_slots: one warp per chunk
};
SlotAssignmentPlan plan_slot_assignment(int64_t tokens, int64_t k, int64_t experts);

// priority_sort_keys: one thread per token.
Grid plan_priority_keys(int64_t tokens);

// --------------------------------------------------- group_by_expert.cu --
// count_expert_choices (one warp per chunk of chunk_choices choices) into a table
// counts[chunks, experts + 1], then place_expert_choices (eight chunks per block, at least one
// block, so that counts and ends are written even without choices) with a second table of that
// size for the chunks' next slots, and, when the bucket starts exceed
// TUTEL_GROUP_SHARED_BUCKETS ints, experts + 2 ints of scratch per block.
struct GroupByExpertPlan {
  int64_t chunk_choices = 0;
  int64_t chunks = 0;
  int64_t table_ints = 0;           // chunks * (experts + 1), for each of the two tables
  int64_t bucket_scratch_ints = 0;  // 0 when the bucket starts fit in shared memory
  Grid count_grid;
  Grid place_grid;
};
GroupByExpertPlan plan_group_by_expert(int64_t tokens, int64_t k, int64_t experts);

// ------------------------------------------------------- expert_rows.cu --
// add_expert_bias and choice_rows: one thread per element of the [rows, columns] rows, or per
// 16-byte vector of elements (`vector`) when the row length, every row pointer and every row
// stride (in elements) allow it.  expert_row_sums: one thread per (expert, column) of its result.
struct ExpertRowsPlan {
  bool vector = false;
  Grid grid;
};
ExpertRowsPlan plan_expert_rows(int64_t rows, int64_t columns, int64_t element_size,
                                std::initializer_list<const void*> row_pointers,
                                std::initializer_list<int64_t> row_strides);
Grid plan_expert_row_sums(int64_t experts, int64_t columns);

// ------------------------------------------------------- gated_units.cu --
// gated_unit_forward / gated_unit_backward: one thread per unit of the [rows, width] result.
Grid plan_gated_units(int64_t rows, int64_t width);

// ---------------------------------------------------------- dispatch.cu --
// How the row kernels walk a row of model_dim elements: 16-byte vectors (the
// *_vector kernels) when the row length and every row pointer allow it, and a
// group of 2^group_log2 lanes per row, just enough to cover a row in one strip
// (at most a warp).
struct RowLayout {
  bool vector = false;
  int group_log2 = 0;
  int64_t rows_per_block() const { return TUTEL_BLOCK_THREADS >> group_log2; }
};
// row_pointers: the data, `other` and output tensors (nullptr when absent).
RowLayout plan_row_layout(int64_t model_dim, int64_t element_size,
                          std::initializer_list<const void*> row_pointers);

// gather_slots_{vector,scalar}: one group of lanes per token.
struct GatherPlan {
  RowLayout layout;
  Grid grid;
};
GatherPlan plan_gather(int64_t tokens, int64_t model_dim, int64_t element_size,
                       std::initializer_list<const void*> row_pointers);

// scatter_claim_slots (one thread per entry) on a slot table of slot_table_ints
// ints, zeroed first unless `grouped` (no indices, distinct locations: an owner
// per slot of expert 0 that is checked before it is trusted), then
// scatter_slots_{vector,scalar} (one group of lanes per slot), whose first
// shared_blocks blocks also sum slots claimed by several entries (never grouped).
struct ScatterPlan {
  RowLayout layout;
  int64_t slot_table_ints = 0;
  Grid claim_grid;
  Grid row_grid;
  int64_t shared_blocks = 0;
};
ScatterPlan plan_scatter(int64_t tokens, int64_t k, int64_t experts, int64_t capacity,
                         int64_t model_dim, int64_t element_size, int multiprocessors,
                         std::initializer_list<const void*> row_pointers, bool grouped = false);

// ---------------------------------------------------- route_experts.cu --
// route_experts_route: one block per chunk of chunk_tokens tokens (at least one block); then
// route_experts_plan, whose blocks take roles in the order they start: rank_blocks (batch-
// prioritized: one thread per token's claiming position), count_blocks (batch-prioritized: one
// per chunk of positions), one per expert (the scan), assign_blocks (one warp per chunk).
// Scratch: int_workspace_ints ints (the phase counters, the table [chunks, k, experts], and for
// batch-prioritized routing the sorted runs' tokens and the claiming order [tokens] each),
// acc_workspace (the loss's chunk sums [chunks, experts] and column sums [experts]) and key_workspace
// (the runs' priority keys [tokens]) elements.  route_experts_backward: one warp per token.
struct RouteExpertsPlan {
  int64_t chunk_tokens = 0;
  int64_t chunks = 0;
  int64_t rows = 0;  // of the grouped buffer
  int64_t table_ints = 0;
  int64_t int_workspace_ints = 0;
  int64_t acc_workspace = 0;
  int64_t key_workspace = 0;
  int64_t rank_blocks = 0, count_blocks = 0, assign_blocks = 0;
  Grid route_grid;
  Grid plan_grid;
};
// `prioritized` and `loss` as the kernels take them (false without tokens).
RouteExpertsPlan plan_route_experts(int64_t tokens, int64_t experts, int64_t k, int64_t capacity, bool prioritized,
                                    bool loss);
Grid plan_route_experts_backward(int64_t tokens);

}  // namespace cuda
}  // namespace tutel
