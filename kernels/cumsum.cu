// variants: TUTEL_MASK_BOOL TUTEL_MASK_UINT8 TUTEL_MASK_INT8 TUTEL_MASK_INT16 TUTEL_MASK_INT32 TUTEL_MASK_INT64 TUTEL_MASK_FLOAT32 TUTEL_MASK_FLOAT64
//
// out[r, c] = sum_{i <= r} x[i, c] - 1 down the rows of a row-major
// [rows, cols] matrix (GShard's "cumsum minus one").  Integers and bool sum
// in int64 (as torch.cumsum does), float32 / float64 in their own type.
// Rows are cut into chunks of chunk_rows: each chunk's column totals, an
// exclusive scan of those per column starting at -1, then each chunk scans its
// rows from its offset.  One thread per column, so reads are coalesced.
#include "tutel_device.cuh"

#if defined(TUTEL_MASK_BOOL) || defined(TUTEL_MASK_UINT8)
typedef unsigned char mask_t;
typedef long long sum_t;
#elif defined(TUTEL_MASK_INT8)
typedef signed char mask_t;
typedef long long sum_t;
#elif defined(TUTEL_MASK_INT16)
typedef short mask_t;
typedef long long sum_t;
#elif defined(TUTEL_MASK_INT32)
typedef int mask_t;
typedef long long sum_t;
#elif defined(TUTEL_MASK_INT64)
typedef long long mask_t;
typedef long long sum_t;
#elif defined(TUTEL_MASK_FLOAT32)
typedef float mask_t;
typedef float sum_t;
#elif defined(TUTEL_MASK_FLOAT64)
typedef double mask_t;
typedef double sum_t;
#else
#error "cumsum.cu needs one -DTUTEL_MASK_<TYPE> option"
#endif

__device__ __forceinline__ i64 chunk_last_row(i64 first, i64 chunk_rows, i64 rows) {
  return first + chunk_rows < rows ? first + chunk_rows : rows;
}

// grid (column blocks, chunks): totals[chunk, c] = sum of the chunk's rows of column c.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    cumsum_chunk_totals(const mask_t* x, i64 rows, i64 cols, i64 chunk_rows, sum_t* totals) {
  const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const i64 first = (i64)blockIdx.y * chunk_rows;
  const i64 last = chunk_last_row(first, chunk_rows, rows);
  sum_t total = sum_t(0);
  for (i64 r = first; r < last; ++r) total += (sum_t)x[r * cols + col];
  totals[(i64)blockIdx.y * cols + col] = total;
}

// One warp per column: totals become each chunk's starting value.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    cumsum_chunk_offsets(sum_t* totals, i64 chunks, i64 cols) {
  const i64 col = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (col >= cols) return;  // whole warps leave together
  warp_exclusive_scan_strided(totals + col, chunks, cols, sum_t(-1));
}

// grid (column blocks, chunks): the running sum down the chunk's rows.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    cumsum_chunk_scan(const mask_t* x, i64 rows, i64 cols, i64 chunk_rows, const sum_t* offsets,
                      sum_t* out) {
  const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const i64 first = (i64)blockIdx.y * chunk_rows;
  const i64 last = chunk_last_row(first, chunk_rows, rows);
  sum_t running = offsets[(i64)blockIdx.y * cols + col];
  for (i64 r = first; r < last; ++r) {
    running += (sum_t)x[r * cols + col];
    out[r * cols + col] = running;
  }
}
