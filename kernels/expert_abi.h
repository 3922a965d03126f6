/* What the expert kernels (grouped_rows_gemm.cu, decode_experts.cu) and their host code
 * (csrc/cuda/launch_plan.h, csrc/ops/cuda) agree on: tile shapes and the argument structs
 * passed by value.  Plain C, read by both compilers. */
#ifndef TUTEL_EXPERT_ABI_H
#define TUTEL_EXPERT_ABI_H

/* grouped_rows_gemm.cu: each block computes a TUTEL_GEMM_TILE x TUTEL_GEMM_TILE tile of a
 * product, stepping through the reduction TUTEL_GEMM_DEPTH at a time. */
#define TUTEL_GEMM_TILE 64
#define TUTEL_GEMM_DEPTH 16

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

#endif /* TUTEL_EXPERT_ABI_H */
