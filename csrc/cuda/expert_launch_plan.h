// How the CUDA operators of the expert products launch their kernels (grouped_rows_gemm.cu,
// decode_experts.cu, quantized_decode.cu, quantized_grouped_linear.cu): grids, kernel choices and scratch sizes for given problem sizes.  Plain
// C++ with no CUDA or framework dependency, shared by the operators (csrc/ops/cuda) and the CPU
// execution of the kernels (tests/cpp/kernels_on_cpu), as launch_plan.h is for the others.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "../../kernels/expert_abi.h"
#include "launch_plan.h"

namespace tutel {
namespace cuda {

// ------------------------------------------------- grouped_rows_gemm.cu --
// grouped_rows_product for a [rows, cols] result over `experts` groups: one block per tile of
// up to TUTEL_GEMM_TILE rows of one group (rows / TILE + experts + 1 of them bound every
// grouping, the rows past the last end included) and of TUTEL_GEMM_TILE columns.  Empty when
// rows or cols is 0.
Grid plan_grouped_rows_product(int64_t rows, int64_t experts, int64_t cols);

// grouped_rows_weight_grad for d [experts, p_cols, q_cols] and, with bias_of 1 (2), the column
// sums of p (q): one block per expert and tile of d, or, without the product, per expert and
// tile of the summed columns only.
struct WeightGradPlan {
  Grid grid;
  int64_t col_tiles = 0;  // the kernel's col_tiles argument
};
WeightGradPlan plan_grouped_rows_weight_grad(int64_t experts, int64_t p_cols, int64_t q_cols, bool product,
                                             int bias_of);

// ---------------------------------------------------- decode_experts.cu --
// The gate/up kernel (decode_gate_up_{rows,columns}_{vector,scalar}) and the down kernel
// (decode_down_*), each with one block per (choice, tile): TUTEL_DECODE_ROWS unit outputs or
// features per tile in the F.linear layout, TUTEL_DECODE_COLUMNS transposed.  The scratch: h
// [pairs, inter] and y [pairs, out_features] in the accumulation type, and one counter per
// (token, down tile).
struct DecodePlan {
  bool gate_up_vector = false;
  bool down_vector = false;
  Grid gate_up_grid;
  Grid down_grid;
  int64_t counter_ints = 0;
};
// x: the token rows (row stride x_stride, read 16 bytes at a time in the F.linear layout only);
// up_matrices: up_weight and gate_weight (nullptr when absent); down_matrix: down_weight.
// For tokens, k, out_features >= 1.
DecodePlan plan_decode_experts(int64_t tokens, int64_t k, int64_t hidden, int64_t inter, int64_t out_features,
                               bool transposed, int64_t element_size, const void* x, int64_t x_stride,
                               std::initializer_list<const void*> up_matrices, const void* down_matrix);

// -------------------------------------------------- quantized_decode.cu --
// The gate/up kernel (quantized_gate_up_<format>_{vector,scalar}) and the down kernel
// (quantized_down_*), with decode_experts' grids (F.linear layout), scratch and counters.  A
// stack's kernel reads 16-byte chunks of codes where its rows are a whole number of them, its
// codes are 16-byte aligned and, for fp8_block, its scale blocks are a multiple of 16 columns wide
// (one scale per chunk); the gate/up kernel also reads the x rows 16 bytes at a time (x aligned,
// its row stride a multiple of 16 bytes), the down kernel the h scratch (allocated aligned).
// format: TUTEL_QUANT_*; block_cols: fp8_block's scale block width (else unused).  For tokens, k,
// out_features >= 1.
DecodePlan plan_quantized_decode(int64_t tokens, int64_t k, int64_t hidden, int64_t inter, int64_t out_features,
                                 int format, int64_t block_cols, int64_t element_size, const void* x,
                                 int64_t x_stride, const void* gate_up_codes, const void* down_codes);

// ------------------------------------------ quantized_grouped_linear.cu --
// quantized_grouped_linear_<format> for a [rows, outputs] result over `experts` groups: one block
// per tile of up to TUTEL_QUANT_TILE_ROWS rows of one group (rows / TILE + experts + 1 of them
// bound every grouping, the rows past the last end included) and of TUTEL_QUANT_TILE_COLS
// outputs.  Sized from the shapes alone (the ends stay on the device).  Empty when rows or
// outputs is 0.
Grid plan_quantized_grouped_linear(int64_t rows, int64_t experts, int64_t outputs);

}  // namespace cuda
}  // namespace tutel
