// The schedule of products over rows grouped by expert whose group ends are read on the device
// (grouped_rows_gemm.cu, quantized_grouped_linear.cu): expert e owns the rows [end[e-1], end[e])
// (end[-1] = 0), end the running maximum of `ends` clamped to [0, rows], and one block takes one
// tile of up to tile_rows rows of one expert, found from its block number by locate_row_tile.
// Kept at global scope: the emulation of tests/cpp/kernels_on_cpu finds the __shared__ variables
// of function templates by their names there.
#pragma once

#include "tutel_device.cuh"

struct MaxOp {
  __device__ static i64 apply(i64 a, i64 b) { return a > b ? a : b; }
};
struct SumOp {
  __device__ static i64 apply(i64 a, i64 b) { return a + b; }
};

// Exclusive scan of one value per thread, in thread order, starting from 0 (values >= 0);
// `total` receives the combination of all of them.  Every thread of the block must call it.
template <class Op>
__device__ i64 block_exclusive_scan(i64 value, i64* total) {
  __shared__ i64 warp_totals[TUTEL_BLOCK_THREADS / 32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  i64 inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const i64 other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= (unsigned)offset) inclusive = Op::apply(inclusive, other);
  }
  i64 exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive = 0;
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  i64 before = 0, all = 0;
  for (unsigned w = 0; w < TUTEL_BLOCK_THREADS / 32; ++w) {
    if (w < warp) before = Op::apply(before, warp_totals[w]);
    all = Op::apply(all, warp_totals[w]);
  }
  __syncthreads();  // warp_totals is read before the next call writes it
  *total = all;
  return Op::apply(before, exclusive);
}

__device__ __forceinline__ i64 clamped_end(const int* ends, i64 g, i64 rows) {
  const i64 v = ends[g];
  return v < 0 ? 0 : (v > rows ? rows : v);
}

// The rows of one tile of a product over grouped rows.  Each expert's rows are cut into tiles of up
// to tile_rows rows starting at its first row, expert after expert, then the rows past the last end
// likewise (expert -1: zero rows); tile numbers past all of them have count 0.  There are at
// most rows / tile_rows + experts + 1 tiles.
struct RowTile {
  i64 begin, count, expert;
};

// Every thread of the block must call it; all get the same answer.  Thread t handles experts
// [t * per, (t + 1) * per): the clamped running maximum of the ends, then each expert's tiles,
// both scanned across the block.
__device__ RowTile locate_row_tile(const int* ends, i64 rows, i64 experts, i64 tile, i64 tile_rows) {
  __shared__ i64 found[3];
  const i64 per = (experts + TUTEL_BLOCK_THREADS - 1) / TUTEL_BLOCK_THREADS;
  const i64 first = (i64)threadIdx.x * per < experts ? (i64)threadIdx.x * per : experts;
  const i64 last = first + per < experts ? first + per : experts;
  if (threadIdx.x == 0) found[1] = 0;  // no expert tile unless one thread finds it below
  i64 chunk_max = 0;
  for (i64 g = first; g < last; ++g) chunk_max = MaxOp::apply(chunk_max, clamped_end(ends, g, rows));
  i64 last_end;
  const i64 end_before = block_exclusive_scan<MaxOp>(chunk_max, &last_end);
  i64 tiles = 0;
  i64 running = end_before;
  for (i64 g = first; g < last; ++g) {
    const i64 end = MaxOp::apply(running, clamped_end(ends, g, rows));
    tiles += (end - running + tile_rows - 1) / tile_rows;
    running = end;
  }
  i64 expert_tiles;
  i64 base = block_exclusive_scan<SumOp>(tiles, &expert_tiles);
  running = end_before;
  for (i64 g = first; g < last; ++g) {
    const i64 end = MaxOp::apply(running, clamped_end(ends, g, rows));
    const i64 own = (end - running + tile_rows - 1) / tile_rows;
    if (tile >= base && tile < base + own) {
      const i64 begin = running + (tile - base) * tile_rows;
      found[0] = begin;
      found[1] = end - begin < tile_rows ? end - begin : tile_rows;
      found[2] = g;
    }
    base += own;
    running = end;
  }
  __syncthreads();
  RowTile t{found[0], found[1], found[2]};
  __syncthreads();  // found is read before a later call could write it
  if (tile >= expert_tiles) {  // the rows past the last end
    t.begin = last_end + (tile - expert_tiles) * tile_rows;
    t.count = t.begin < rows ? (rows - t.begin < tile_rows ? rows - t.begin : tile_rows) : 0;
    t.expert = -1;
  }
  return t;
}
