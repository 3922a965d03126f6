#include "launch_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../core/route_experts.h"

namespace tutel {
namespace cuda {
namespace {

const char* const kVariantDefines[] = {
    "",
    "TUTEL_DTYPE_FLOAT32", "TUTEL_DTYPE_FLOAT64", "TUTEL_DTYPE_FLOAT16", "TUTEL_DTYPE_BFLOAT16",
    "TUTEL_MASK_BOOL", "TUTEL_MASK_UINT8", "TUTEL_MASK_INT8", "TUTEL_MASK_INT16",
    "TUTEL_MASK_INT32", "TUTEL_MASK_INT64", "TUTEL_MASK_FLOAT32", "TUTEL_MASK_FLOAT64"};
static_assert(sizeof(kVariantDefines) / sizeof(kVariantDefines[0]) == static_cast<int>(Variant::kCount),
              "one define per variant");

// cumsum: rows per chunk, 128, or more so that the chunks fit the grid's y extent.
constexpr int64_t kChunkRows = 128;
constexpr int64_t kMaxGridY = 65535;

// Vectors each lane of a row group handles per strip (TUTEL_UNROLL in dispatch.cu).
constexpr int64_t kUnroll = 4;

constexpr int64_t kWarpsPerBlock = TUTEL_BLOCK_THREADS / 32;

}  // namespace

bool grid_fits(Grid grid) {
  return grid.x <= std::numeric_limits<int32_t>::max() && grid.y <= kMaxGridY;
}

const char* variant_define(Variant variant) { return kVariantDefines[static_cast<int>(variant)]; }

CumsumPlan plan_cumsum(int64_t rows, int64_t cols) {
  CumsumPlan plan;
  plan.chunk_rows = std::max(kChunkRows, blocks_for(rows, kMaxGridY));
  plan.chunks = blocks_for(rows, plan.chunk_rows);
  plan.chunk_grid = Grid{blocks_for(cols, TUTEL_BLOCK_THREADS), plan.chunks};
  plan.offsets_grid = Grid{blocks_for(cols * 32, TUTEL_BLOCK_THREADS), 1};
  return plan;
}

SlotAssignmentPlan plan_slot_assignment(int64_t tokens, int64_t k, int64_t experts) {
  SlotAssignmentPlan plan;
  // 64 tokens per chunk, or more when k * experts is large, so the table stays
  // near 4 ints per token.
  plan.chunk_tokens = 64 * std::max<int64_t>(1, (k * experts + 255) / 256);
  plan.chunks = blocks_for(tokens, plan.chunk_tokens);
  plan.table_ints = plan.chunks * k * experts;
  plan.chunk_grid = Grid{plan.chunks, 1};
  plan.scan_grid = Grid{blocks_for(experts * 32, TUTEL_BLOCK_THREADS), 1};
  plan.assign_grid = Grid{blocks_for(plan.chunks, kWarpsPerBlock), 1};
  return plan;
}

Grid plan_priority_keys(int64_t tokens) { return Grid{blocks_for(tokens, TUTEL_BLOCK_THREADS), 1}; }

GroupByExpertPlan plan_group_by_expert(int64_t tokens, int64_t k, int64_t experts) {
  GroupByExpertPlan plan;
  const int64_t choices = tokens * k, buckets = experts + 1;
  // Each placing block (eight chunks) reads every chunk's row of counts: chunks * chunks / 8 *
  // buckets reads in all.  Chunks of sqrt(choices * buckets / 32) choices (whole warps, at
  // least 256) make that about four per choice, while many chunks still spread the work.
  const auto balanced = int64_t(std::ceil(std::sqrt(double(choices) * double(buckets) / 32.0)));
  plan.chunk_choices = std::max<int64_t>(256, blocks_for(balanced, 32) * 32);
  plan.chunks = blocks_for(choices, plan.chunk_choices);
  plan.table_ints = plan.chunks * buckets;
  plan.count_grid = Grid{blocks_for(plan.chunks, kWarpsPerBlock), 1};
  plan.place_grid = Grid{std::max<int64_t>(1, plan.count_grid.x), 1};
  if (buckets + 1 > TUTEL_GROUP_SHARED_BUCKETS) plan.bucket_scratch_ints = plan.place_grid.x * (buckets + 1);
  return plan;
}

ExpertRowsPlan plan_expert_rows(int64_t rows, int64_t columns, int64_t element_size,
                                std::initializer_list<const void*> row_pointers,
                                std::initializer_list<int64_t> row_strides) {
  const int64_t width = 16 / element_size;
  ExpertRowsPlan plan;
  plan.vector = columns % width == 0;
  for (const void* pointer : row_pointers)
    if (reinterpret_cast<uintptr_t>(pointer) % 16 != 0) plan.vector = false;
  for (int64_t stride : row_strides)
    if (stride % width != 0) plan.vector = false;
  plan.grid = Grid{blocks_for(rows * (plan.vector ? columns / width : columns), TUTEL_BLOCK_THREADS), 1};
  return plan;
}

Grid plan_expert_row_sums(int64_t experts, int64_t columns) {
  return Grid{blocks_for(experts * columns, TUTEL_BLOCK_THREADS), 1};
}

Grid plan_gated_units(int64_t rows, int64_t width) {
  return Grid{blocks_for(rows * width, TUTEL_BLOCK_THREADS), 1};
}

RowLayout plan_row_layout(int64_t model_dim, int64_t element_size,
                          std::initializer_list<const void*> row_pointers) {
  const int64_t width = 16 / element_size;
  bool vector = model_dim % width == 0;
  for (const void* pointer : row_pointers)
    if (reinterpret_cast<uintptr_t>(pointer) % 16 != 0) vector = false;
  const int64_t vectors = vector ? model_dim / width : model_dim;
  const int64_t lanes_needed = (vectors + kUnroll - 1) / kUnroll;
  RowLayout layout;
  layout.vector = vector;
  while (layout.group_log2 < 5 && (int64_t(1) << layout.group_log2) < lanes_needed) ++layout.group_log2;
  return layout;
}

GatherPlan plan_gather(int64_t tokens, int64_t model_dim, int64_t element_size,
                       std::initializer_list<const void*> row_pointers) {
  GatherPlan plan;
  plan.layout = plan_row_layout(model_dim, element_size, row_pointers);
  plan.grid = Grid{blocks_for(tokens, plan.layout.rows_per_block()), 1};
  return plan;
}

ScatterPlan plan_scatter(int64_t tokens, int64_t k, int64_t experts, int64_t capacity,
                         int64_t model_dim, int64_t element_size, int multiprocessors,
                         std::initializer_list<const void*> row_pointers, bool grouped) {
  ScatterPlan plan;
  const int64_t slots = experts * capacity;
  plan.layout = plan_row_layout(model_dim, element_size, row_pointers);
  // Grouped: an owner per slot of expert 0, the only expert a choice can name.
  plan.slot_table_ints = grouped ? capacity : 2 * slots + 1;
  plan.claim_grid = Grid{blocks_for(k * tokens, TUTEL_BLOCK_THREADS), 1};
  plan.row_grid = Grid{blocks_for(slots, plan.layout.rows_per_block()), 1};
  // Blocks that also sum slots claimed more than once, if there are any.
  plan.shared_blocks = std::max<int64_t>(1, std::min<int64_t>(plan.row_grid.x, multiprocessors));
  return plan;
}

RouteExpertsPlan plan_route_experts(int64_t tokens, int64_t experts, int64_t k, int64_t capacity, bool prioritized,
                                    bool loss) {
  RouteExpertsPlan plan;
  plan.chunk_tokens = core::route_experts_chunk_tokens(tokens);
  plan.chunks = core::route_experts_chunks(tokens);
  plan.rows = core::route_experts_rows(tokens, experts, k, capacity);
  plan.table_ints = plan.chunks * k * experts;
  plan.int_workspace_ints = TUTEL_ROUTE_SYNC_INTS + plan.table_ints + (prioritized ? 2 * tokens : 0);
  plan.acc_workspace = loss ? (plan.chunks + 1) * experts : 0;
  plan.key_workspace = prioritized ? tokens : 0;
  plan.rank_blocks = prioritized ? blocks_for(tokens, TUTEL_BLOCK_THREADS) : 0;
  plan.count_blocks = prioritized ? plan.chunks : 0;
  plan.assign_blocks = blocks_for(plan.chunks, kWarpsPerBlock);
  plan.route_grid = Grid{plan.chunks, 1};
  plan.plan_grid = Grid{plan.rank_blocks + plan.count_blocks + experts + plan.assign_blocks, 1};
  return plan;
}

Grid plan_route_experts_backward(int64_t tokens) { return Grid{blocks_for(tokens, kWarpsPerBlock), 1}; }

}  // namespace cuda
}  // namespace tutel
