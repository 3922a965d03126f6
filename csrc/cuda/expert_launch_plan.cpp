#include "expert_launch_plan.h"

#include <algorithm>
#include <cstdint>

namespace tutel {
namespace cuda {
namespace {

bool aligned_16(std::initializer_list<const void*> pointers) {
  for (const void* pointer : pointers)
    if (reinterpret_cast<uintptr_t>(pointer) % 16 != 0) return false;
  return true;
}

}  // namespace

Grid plan_grouped_rows_product(int64_t rows, int64_t experts, int64_t cols) {
  if (rows == 0 || cols == 0) return Grid{0, 0};
  return Grid{rows / TUTEL_GEMM_TILE + experts + 1, blocks_for(cols, TUTEL_GEMM_TILE)};
}

WeightGradPlan plan_grouped_rows_weight_grad(int64_t experts, int64_t p_cols, int64_t q_cols, bool product,
                                             int bias_of) {
  WeightGradPlan plan;
  int64_t row_tiles = blocks_for(p_cols, TUTEL_GEMM_TILE), col_tiles = blocks_for(q_cols, TUTEL_GEMM_TILE);
  if (!product) {  // only the tiles that sum bias columns: the first tile column (row)
    if (bias_of == 1) col_tiles = 1;
    if (bias_of == 2) row_tiles = 1;
  } else if (bias_of != 0) {  // an empty side still needs the blocks that sum the other
    row_tiles = std::max<int64_t>(row_tiles, 1);
    col_tiles = std::max<int64_t>(col_tiles, 1);
  }
  plan.col_tiles = col_tiles;
  plan.grid = (product || bias_of != 0) ? Grid{row_tiles * col_tiles, experts} : Grid{0, 0};
  return plan;
}

DecodePlan plan_decode_experts(int64_t tokens, int64_t k, int64_t hidden, int64_t inter, int64_t out_features,
                               bool transposed, int64_t element_size, const void* x, int64_t x_stride,
                               std::initializer_list<const void*> up_matrices, const void* down_matrix) {
  DecodePlan plan;
  const int64_t width = 16 / element_size;  // elements per 16-byte load
  const int64_t pairs = tokens * k;
  if (transposed) {  // 16-byte strips of columns: whole strips of gates and of ups
    plan.gate_up_vector = inter % width == 0 && aligned_16(up_matrices);
    plan.down_vector = out_features % width == 0 && aligned_16({down_matrix});
  } else {  // 16-byte pieces of rows: x rows and matrix rows of whole vectors
    plan.gate_up_vector =
        hidden % width == 0 && x_stride % width == 0 && aligned_16({x}) && aligned_16(up_matrices);
    plan.down_vector = inter % width == 0 && aligned_16({down_matrix});  // and the h scratch, allocated aligned
  }
  const int64_t tile = transposed ? TUTEL_DECODE_COLUMNS : TUTEL_DECODE_ROWS;
  // At least one gate/up tile: its blocks also zero the counters and the tokens without a choice.
  plan.gate_up_grid = Grid{pairs, std::max<int64_t>(1, blocks_for(inter, tile))};
  plan.down_grid = Grid{pairs, blocks_for(out_features, tile)};
  plan.counter_ints = tokens * plan.down_grid.y;
  return plan;
}

namespace {

// Whether a quantized stack with rows of `cols` elements is read in 16-byte chunks of codes.
bool quantized_chunks(int format, int64_t cols, int64_t block_cols, const void* codes) {
  const int64_t row_bytes = format == TUTEL_QUANT_FP8_BLOCK ? cols : cols / 2;
  if (format == TUTEL_QUANT_FP8_BLOCK && block_cols % 16 != 0) return false;
  return row_bytes % 16 == 0 && aligned_16({codes});
}

}  // namespace

DecodePlan plan_quantized_decode(int64_t tokens, int64_t k, int64_t hidden, int64_t inter, int64_t out_features,
                                 int format, int64_t block_cols, int64_t element_size, const void* x,
                                 int64_t x_stride, const void* gate_up_codes, const void* down_codes) {
  DecodePlan plan;
  const int64_t width = 16 / element_size;  // activations per 16-byte load
  plan.gate_up_vector = quantized_chunks(format, hidden, block_cols, gate_up_codes) && x_stride % width == 0 &&
                        aligned_16({x});
  plan.down_vector = quantized_chunks(format, inter, block_cols, down_codes);
  const int64_t pairs = tokens * k;
  // At least one gate/up tile: its blocks also zero the counters and the tokens without a choice.
  plan.gate_up_grid = Grid{pairs, std::max<int64_t>(1, blocks_for(inter, TUTEL_DECODE_ROWS))};
  plan.down_grid = Grid{pairs, blocks_for(out_features, TUTEL_DECODE_ROWS)};
  plan.counter_ints = tokens * plan.down_grid.y;
  return plan;
}

Grid plan_quantized_grouped_linear(int64_t rows, int64_t experts, int64_t outputs) {
  if (rows == 0 || outputs == 0) return Grid{0, 0};
  return Grid{rows / TUTEL_QUANT_TILE_ROWS + experts + 1, blocks_for(outputs, TUTEL_QUANT_TILE_COLS)};
}

}  // namespace cuda
}  // namespace tutel
