// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT64 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// Grouped matrix products over rows sorted by expert, with the groups' ends read on the device,
// so no size travels to the host (tutel::grouped_rows_linear and its backward,
// csrc/ops/cuda/grouped_rows_linear_cuda.cpp).  Expert e owns the rows [end[e-1], end[e]) of
// the row matrices (end[-1] = 0), where end is the running maximum of `ends` clamped to
// [0, rows]: every row belongs to at most one expert, and the rows past end[E-1] to none.
//
//   grouped_rows_product:      out[i] = a[i] @ B_e (+ bias[e]) for expert e's rows i; zero for
//                              the rows past end[E-1]
//   grouped_rows_weight_grad:  d[e] = P_e^T Q_e over expert e's rows (zero for an expert without
//                              rows), and the column sums of P_e or Q_e (the bias gradient)
//
// Tiled SIMT products: every block computes a 64 x 64 output tile, 16 steps of the reduction at
// a time through shared memory, each of its 256 threads a 4 x 4 block of sums in acc_t
// (float32 for 16-bit data, float64 for float64).  Each tile's sums run in one fixed order, so
// results do not vary from run to run.
#include "expert_abi.h"
#include "tutel_device.cuh"
#include "grouped_rows.cuh"

#ifndef TUTEL_HAS_DTYPE
#error "grouped_rows_gemm.cu needs one -DTUTEL_DTYPE_<TYPE> option"
#endif

#define TILE TUTEL_GEMM_TILE
#define DEPTH TUTEL_GEMM_DEPTH
// Threads per side of the 16 x 16 thread grid; thread (ty, tx) sums rows ty + 16 i and
// columns tx + 16 j of the tile, i, j < 4.
#define SIDE 16
#define PER_THREAD (TILE / SIDE)

// How B_e is stored: B_e[r][c] (r the reduction index, c the output column) at
//   kReductionContiguous: b[(e * cols + c) * depth + r]   (an F.linear weight [E, O, K])
//   kColumnsContiguous:   b[(e * depth + r) * cols + c]   (a weight [E, K, O])
#define TUTEL_REDUCTION_CONTIGUOUS 0
#define TUTEL_COLUMNS_CONTIGUOUS 1

// a * b + c rounded once (a fused multiply-add), whatever --fmad says: these sums are compared with
// other orders of summation only to rounding (the self-check, the tests), never bit for bit, so they
// take the GPU's fused instruction, one rounding per term instead of two.
__device__ __forceinline__ acc_t fused_multiply_add(acc_t a, acc_t b, acc_t c) {
#if defined(TUTEL_DTYPE_FLOAT64)
  return fma(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}

// sums[i][j] += sum over the step's rows kk of p[kk][ty + 16 i] * q[kk][tx + 16 j], kk in order.
__device__ __forceinline__ void add_tile_products(const acc_t (*p)[TILE + 1], const acc_t (*q)[TILE + 1], int tx,
                                                  int ty, acc_t (*sums)[PER_THREAD]) {
#pragma unroll
  for (int kk = 0; kk < DEPTH; ++kk) {
    acc_t pv[PER_THREAD], qv[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) pv[i] = p[kk][ty + SIDE * i];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) qv[j] = q[kk][tx + SIDE * j];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i)
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) sums[i][j] = fused_multiply_add(pv[i], qv[j], sums[i][j]);
  }
}

// grid (rows / TILE + experts + 1, column tiles): out[i, c] = sum_r a[i, r] * B_e[r][c]
// (+ bias[e, c]) for the block's tile of rows and columns; zeros for rows past the last end.
// a: [rows, depth] with row stride a_stride; out: [rows, cols].
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    grouped_rows_product(const storage_t* a, i64 a_stride, const storage_t* b, int b_layout,
                         const storage_t* bias, const int* ends, i64 rows, i64 experts, i64 depth,
                         i64 cols, storage_t* out) {
  __shared__ acc_t a_tile[DEPTH][TILE + 1];  // padded: the stores of one warp hit distinct banks
  __shared__ acc_t b_tile[DEPTH][TILE + 1];
  const RowTile tile = locate_row_tile(ends, rows, experts, blockIdx.x, TILE);
  if (tile.count == 0) return;  // the same for every thread
  const int tx = threadIdx.x % SIDE, ty = threadIdx.x / SIDE;
  const i64 col0 = (i64)blockIdx.y * TILE;
  acc_t sums[PER_THREAD][PER_THREAD];
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i)
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) sums[i][j] = acc_t(0);

  if (tile.expert >= 0) {
    const i64 e = tile.expert;
    for (i64 r0 = 0; r0 < depth; r0 += DEPTH) {
      // Each thread stores TILE * DEPTH / 256 = 4 elements of each tile; neighbouring threads
      // read neighbouring elements of memory.
#pragma unroll
      for (int q = 0; q < TILE * DEPTH / TUTEL_BLOCK_THREADS; ++q) {
        const int at = threadIdx.x + q * TUTEL_BLOCK_THREADS;
        const int m = at / DEPTH, kk = at % DEPTH;
        a_tile[kk][m] = m < tile.count && r0 + kk < depth ? to_acc(a[(tile.begin + m) * a_stride + r0 + kk])
                                                          : acc_t(0);
        int c, r;
        if (b_layout == TUTEL_REDUCTION_CONTIGUOUS) {
          c = at / DEPTH;
          r = at % DEPTH;
        } else {
          c = at % TILE;
          r = at / TILE;
        }
        const bool inside = col0 + c < cols && r0 + r < depth;
        const i64 offset = b_layout == TUTEL_REDUCTION_CONTIGUOUS ? (e * cols + col0 + c) * depth + r0 + r
                                                                 : (e * depth + r0 + r) * cols + col0 + c;
        b_tile[r][c] = inside ? to_acc(b[offset]) : acc_t(0);
      }
      __syncthreads();
      add_tile_products(a_tile, b_tile, tx, ty, sums);
      __syncthreads();  // the tiles are read before the next step overwrites them
    }
  }
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const i64 m = ty + SIDE * i;
    if (m >= tile.count) continue;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const i64 c = col0 + tx + SIDE * j;
      if (c >= cols) continue;
      acc_t v = sums[i][j];
      if (tile.expert >= 0 && bias) v = v + to_acc(bias[tile.expert * cols + c]);
      out[(tile.begin + m) * cols + c] = tile.expert >= 0 ? from_acc(v) : storage_t(0);
    }
  }
}

// Expert e's rows [begin, end) (see the file comment); every thread of the block must call it.
__device__ void expert_rows(const int* ends, i64 rows, i64 e, i64* begin, i64* end) {
  i64 before = 0, through = 0;
  for (i64 g = threadIdx.x; g <= e; g += TUTEL_BLOCK_THREADS) {
    const i64 v = clamped_end(ends, g, rows);
    if (g < e) before = MaxOp::apply(before, v);
    through = MaxOp::apply(through, v);
  }
  block_exclusive_scan<MaxOp>(before, begin);
  block_exclusive_scan<MaxOp>(through, end);
}

// grid (row tiles * col_tiles, experts): d[e][r][c] = sum_i p[i, r] * q[i, c] over expert e's
// rows i (p: [rows, p_cols] with row stride p_stride, q likewise; d: [experts, p_cols, q_cols]),
// written when write_product; with bias_of = 1 (2) also d_bias[e][r] = sum_i p[i, r]
// (d_bias[e][c] = sum_i q[i, c]), by the blocks of the first column (row) tile.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    grouped_rows_weight_grad(const storage_t* p, i64 p_stride, const storage_t* q, i64 q_stride,
                             const int* ends, i64 rows, i64 p_cols, i64 q_cols, i64 col_tiles,
                             int write_product, int bias_of, storage_t* d, storage_t* d_bias) {
  __shared__ acc_t p_tile[DEPTH][TILE + 1];
  __shared__ acc_t q_tile[DEPTH][TILE + 1];
  const i64 e = blockIdx.y;
  i64 begin, end;
  expert_rows(ends, rows, e, &begin, &end);
  const int tx = threadIdx.x % SIDE, ty = threadIdx.x / SIDE;
  const i64 r0 = (i64)(blockIdx.x / col_tiles) * TILE, c0 = (i64)(blockIdx.x % col_tiles) * TILE;
  // Which threads sum bias columns: those of the first tile column (row) in one thread column (row).
  const bool bias_rows = bias_of == 1 && c0 == 0 && tx == 0;
  const bool bias_cols = bias_of == 2 && r0 == 0 && ty == 0;
  acc_t sums[PER_THREAD][PER_THREAD], bias_sums[PER_THREAD];
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    bias_sums[i] = acc_t(0);
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) sums[i][j] = acc_t(0);
  }
  for (i64 i0 = begin; i0 < end; i0 += DEPTH) {
#pragma unroll
    for (int s = 0; s < TILE * DEPTH / TUTEL_BLOCK_THREADS; ++s) {
      const int at = threadIdx.x + s * TUTEL_BLOCK_THREADS;
      const int col = at % TILE, kk = at / TILE;
      const bool row_inside = i0 + kk < end;
      p_tile[kk][col] = row_inside && r0 + col < p_cols ? to_acc(p[(i0 + kk) * p_stride + r0 + col]) : acc_t(0);
      q_tile[kk][col] = row_inside && c0 + col < q_cols ? to_acc(q[(i0 + kk) * q_stride + c0 + col]) : acc_t(0);
    }
    __syncthreads();
    if (write_product) add_tile_products(p_tile, q_tile, tx, ty, sums);
    if (bias_rows || bias_cols) {
      for (int kk = 0; kk < DEPTH; ++kk)
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i)
          bias_sums[i] = bias_sums[i] + (bias_rows ? p_tile[kk][ty + SIDE * i] : q_tile[kk][tx + SIDE * i]);
    }
    __syncthreads();  // the tiles are read before the next step overwrites them
  }
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const i64 r = r0 + ty + SIDE * i;
    if (write_product && r < p_cols) {
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) {
        const i64 c = c0 + tx + SIDE * j;
        if (c < q_cols) d[(e * p_cols + r) * q_cols + c] = from_acc(sums[i][j]);
      }
    }
    if (bias_rows && r < p_cols) d_bias[e * p_cols + r] = from_acc(bias_sums[i]);
    const i64 c = c0 + tx + SIDE * i;
    if (bias_cols && c < q_cols) d_bias[e * q_cols + c] = from_acc(bias_sums[i]);
  }
}
