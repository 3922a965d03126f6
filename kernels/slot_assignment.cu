// variants: (none)
//
// GShard slot assignment on the GPU.  The tokens (in token order, or in the
// claiming `order` for batch-prioritized routing) are cut into chunks of
// chunk_tokens positions, and a table [chunks, k, experts] is built in three
// steps:
//   1. counts:  tokens of the chunk per (choice, expert)  (count_choices, or
//               fused into route_topk);
//   2. offsets: per expert, an exclusive scan over (choice, chunk) in that
//               order, so that every first choice comes before any second
//               choice (scan_choice_counts, which also writes counts [k, E]);
//   3. slots:   each chunk walks its positions in order and hands out slots
//               starting from its offsets (assign_slots).
// The result equals the CPU's sequential rule exactly:
//   location[j, t] = sum_{i<j} counts[i, e] + #{tokens before t in order with choice j == e}.
#include "tutel_device.cuh"

// Written for a choice whose expert index is out of range: larger than any
// capacity, so a later dispatch drops it.
#define TUTEL_INVALID_LOCATION 0x7fffffff

__device__ __forceinline__ i64 chunk_end(i64 first, i64 chunk_tokens, i64 tokens) {
  return first + chunk_tokens < tokens ? first + chunk_tokens : tokens;
}

// Step 1 for given indices: one block per chunk.  Out-of-range indices are
// reported (when the sink is set) and not counted.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    count_choices(const int* indices, const int* order, i64 tokens, i64 k, i64 experts,
                  i64 chunk_tokens, int* chunk_counts, TutelErrorSink errors) {
  const i64 first = (i64)blockIdx.x * chunk_tokens;
  const i64 last = chunk_end(first, chunk_tokens, tokens);
  int* counts = chunk_counts + (i64)blockIdx.x * k * experts;
  for (i64 i = threadIdx.x; i < k * experts; i += blockDim.x) counts[i] = 0;
  __syncthreads();
  for (i64 j = 0; j < k; ++j) {
    for (i64 pos = first + threadIdx.x; pos < last; pos += blockDim.x) {
      const i64 t = order ? order[pos] : pos;
      const int e = indices[j * tokens + t];
      if (e < 0 || e >= experts) {
        report_data_error(errors, TUTEL_OP_ASSIGN_LOCATIONS, tokens, j * tokens + t,
                          TUTEL_ERROR_EXPERT_INDEX, e);
        continue;
      }
      atomicAdd(counts + j * experts + e, 1);
    }
  }
}

// Step 2: one warp per expert.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    scan_choice_counts(int* chunk_counts, i64 chunks, i64 k, i64 experts, int* counts) {
  const i64 e = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (e >= experts) return;  // whole warps leave together
  int running = 0;
  for (i64 j = 0; j < k; ++j) {
    const int before = running;
    running = warp_exclusive_scan_strided(chunk_counts + j * experts + e, chunks, k * experts, running);
    if ((threadIdx.x & 31u) == 0) counts[j * experts + e] = running - before;
  }
}

// Per warp, the chunk's next free slot per (choice, expert) is kept in shared
// memory when the table is at most this many ints (8 warps x 4 KiB).
#define TUTEL_ASSIGN_CACHE_INTS 1024

// Step 3: one warp per chunk, 32 positions at a time (claim_slots: lanes that
// picked the same expert take consecutive slots in lane = claiming order).
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    assign_slots(const int* indices, const int* order, i64 tokens, i64 k, i64 experts,
                 i64 chunk_tokens, i64 chunks, int* chunk_offsets, int* locations) {
  __shared__ int cache[TUTEL_BLOCK_THREADS / 32][TUTEL_ASSIGN_CACHE_INTS];
  const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const i64 chunk = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= chunks) return;  // whole warps leave together
  const i64 table = k * experts;
  int* next_slot = chunk_offsets + chunk * table;
  if (table <= TUTEL_ASSIGN_CACHE_INTS) {
    for (i64 i = lane; i < table; i += 32) cache[warp][i] = next_slot[i];
    next_slot = cache[warp];
    __syncwarp();
  }
  const i64 first = chunk * chunk_tokens;
  const i64 last = chunk_end(first, chunk_tokens, tokens);
  for (i64 j = 0; j < k; ++j) {
    int* next_j = next_slot + j * experts;
    for (i64 base = first; base < last; base += 32) {
      const i64 pos = base + lane;
      const bool active = pos < last;
      const i64 t = active ? (order ? order[pos] : pos) : 0;
      const int e = active ? indices[j * tokens + t] : -1;
      const bool valid = active && e >= 0 && e < experts;
      const int slot = claim_slots(next_j, e, valid);
      if (active) locations[j * tokens + t] = valid ? slot : TUTEL_INVALID_LOCATION;
    }
  }
}
