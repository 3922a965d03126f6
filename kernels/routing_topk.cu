// variants: TUTEL_DTYPE_FLOAT32 TUTEL_DTYPE_FLOAT64 TUTEL_DTYPE_FLOAT16 TUTEL_DTYPE_BFLOAT16
//
// Top-k expert selection, with the same ranking as the CPU kernel: best first,
// NaN above every number, equal scores (and +0 / -0) to the lower expert index.
#include "tutel_device.cuh"

#ifndef TUTEL_HAS_DTYPE
#error "routing_topk.cu needs one -DTUTEL_DTYPE_<TYPE> option"
#endif

// The best expert of `row` among those ranking after `previous` (all experts
// when previous.index < 0).  Called by a whole warp; every lane gets the result.
__device__ Candidate warp_best_after(const storage_t* row, i64 experts, Candidate previous) {
  Candidate best{acc_t(0), -1};
  for (i64 e = threadIdx.x & 31u; e < experts; e += 32) {
    const Candidate c{to_acc(row[e]), (int)e};
    if (previous.index >= 0 && !ranks_before(previous, c)) continue;
    if (best.index < 0 || ranks_before(c, best)) best = c;
  }
  return warp_best(best);
}

// One block per chunk of `chunk_tokens` tokens, one warp per token.  Writes
// indices / gates [k, tokens] and, when chunk_counts is given, the chunk's
// row of the per-chunk table [chunks, k, experts] of tokens per (choice, expert)
// that slot assignment starts from (so routing needs no separate counting pass).
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    route_topk(const storage_t* scores, i64 tokens, i64 experts, i64 k, i64 chunk_tokens,
               int* indices, storage_t* gates, int* chunk_counts) {
  const i64 first = (i64)blockIdx.x * chunk_tokens;
  const i64 last = first + chunk_tokens < tokens ? first + chunk_tokens : tokens;
  int* counts = chunk_counts ? chunk_counts + (i64)blockIdx.x * k * experts : 0;
  if (counts) {
    for (i64 i = threadIdx.x; i < k * experts; i += blockDim.x) counts[i] = 0;
    __syncthreads();
  }
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = blockDim.x >> 5;
  for (i64 t = first + (threadIdx.x >> 5); t < last; t += warps) {
    const storage_t* row = scores + t * experts;
    Candidate chosen{acc_t(0), -1};
    for (i64 j = 0; j < k; ++j) {
      chosen = warp_best_after(row, experts, chosen);
      if (lane == 0) {
        indices[j * tokens + t] = chosen.index;
        gates[j * tokens + t] = row[chosen.index];
        if (counts) atomicAdd(counts + j * experts + chosen.index, 1);
      }
    }
  }
}

// Sort keys for batch-prioritized routing (see priority_sort_key).
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    priority_sort_keys(const storage_t* priority, i64 tokens, sort_key_t* keys) {
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  keys[t] = priority_sort_key(to_acc(priority[t]));
}
