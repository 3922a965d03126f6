/* What the expert kernels (grouped_rows_gemm.cu, decode_experts.cu, quantized_decode.cu,
 * quantized_grouped_linear.cu) and their host code
 * (csrc/cuda/launch_plan.h, csrc/ops/cuda) agree on: tile shapes and the argument structs
 * passed by value.  Plain C, read by both compilers. */
#ifndef TUTEL_EXPERT_ABI_H
#define TUTEL_EXPERT_ABI_H

/* grouped_rows_gemm.cu: each block computes a TUTEL_GEMM_TILE x TUTEL_GEMM_TILE tile of a
 * product, stepping through the reduction TUTEL_GEMM_DEPTH at a time. */
#define TUTEL_GEMM_TILE 64
#define TUTEL_GEMM_DEPTH 16

/* quantized_grouped_linear.cu: each block computes a tile of TUTEL_QUANT_TILE_ROWS grouped rows
 * (of one expert) by TUTEL_QUANT_TILE_COLS output features, TUTEL_QUANT_TILE_DEPTH input features
 * at a time. */
#define TUTEL_QUANT_TILE_ROWS 64
#define TUTEL_QUANT_TILE_COLS 64
#define TUTEL_QUANT_TILE_DEPTH 64

/* decode_experts.cu: the unit outputs (gate/up kernel) or output features (down kernel) of one
 * block.  Matrices in the F.linear layout give each warp one of them (a matrix row);
 * transposed matrices spread TUTEL_DECODE_COLUMNS of them over the lanes. */
#define TUTEL_DECODE_ROWS 8
#define TUTEL_DECODE_COLUMNS 32

/* The dtype of the routing weights: TUTEL_WEIGHTS_* (kernel_abi.h; decode_experts.cu reads any of
 * them as they are). */
#include "kernel_abi.h"

/* decode_experts.cu: the routing of `tokens` tokens to `k` experts each.  Expert ids are int32
 * or int64 (ids_int64), weights of dtype TUTEL_WEIGHTS_* or absent (weights == 0: weight 1);
 * strides in elements.  An id outside [0, experts) is a dropped choice. */
struct TutelDecodeRouting {
  const void* expert_ids;
  long long ids_token_stride;
  long long ids_choice_stride;
  const void* weights;
  long long weights_token_stride;
  long long weights_choice_stride;
  long long tokens;
  long long k;
  long long experts;
  int ids_int64;
  int weights_dtype;
};

/* decode_experts.cu: the gated unit h = (u' + up_offset) * g' * sigmoid(alpha * g'), with
 * g' = min(g, limit), u' = clamp(u, -limit, limit) when clamped (see csrc/core/gated_units.h). */
struct TutelDecodeUnit {
  double alpha;
  double up_offset;
  double limit;
  int clamped;
  int interleaved;
};

/* quantized_decode.cu: the unit between the two products (as csrc/core/quantized_decode.h's
 * ExpertActivation): the gated unit of TutelDecodeUnit over gate and up rows, or an up-only unit. */
#define TUTEL_UNIT_GATED 0
#define TUTEL_UNIT_GELU 1
#define TUTEL_UNIT_GELU_TANH 2
#define TUTEL_UNIT_RELU 3

/* quantized_decode.cu, quantized_grouped_linear.cu: the weight formats (as csrc/core/quant_codes.h's QuantFormat). */
#define TUTEL_QUANT_MXFP4 0
#define TUTEL_QUANT_NVFP4 1
#define TUTEL_QUANT_FP8_BLOCK 2

/* quantized_decode.cu, quantized_grouped_linear.cu: one stack [E, rows, cols] of expert matrices, every array contiguous:
 * codes uint8 [E, rows, cols / 2] (two E2M1 codes a byte, the even element in the low nibble) or
 * E4M3 bytes [E, rows, cols] (fp8_block); scales E8M0 bytes [E, rows, cols / 32] (mxfp4), E4M3
 * bytes [E, rows, cols / 16] (nvfp4) or float32 [E, ceil(rows / block_rows), ceil(cols /
 * block_cols)] (fp8_block); global: nvfp4's float32 [E] scale per matrix, else 0. */
struct TutelQuantMatrix {
  const unsigned char* codes;
  const void* scales;
  const float* global;
  long long rows;
  long long cols;
  long long block_rows;
  long long block_cols;
};

#endif /* TUTEL_EXPERT_ABI_H */
