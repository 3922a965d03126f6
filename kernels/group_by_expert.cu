// variants: (none)
//
// tutel::group_by_expert (csrc/core/routing.h's group_choices_by_expert): the T * k choices of
// expert_ids [T, k], numbered c = t * k + j, sorted by expert, stably in that order; ids
// outside [0, experts) form one last bucket (number `experts`) of dropped choices.  A counting
// sort in two launches and no host synchronisation:
//   1. count_expert_choices: the choices are cut into chunks of chunk_choices; one warp per
//      chunk counts them per bucket into the chunk's row of counts [chunks, experts + 1];
//   2. place_expert_choices: every block sums the rows itself (each bucket's choices before
//      each of the block's chunks, and each bucket's total), scans the totals into the buckets'
//      starts, and its warps hand out the slots of their chunks.
// A chunk's slots of bucket e start at start[e] + (choices of e in earlier chunks), and inside
// a chunk the lanes that picked one bucket take consecutive slots in choice order, so the
// result is the CPU's sequential placement exactly.  Block 0 also writes counts and ends.
// Every block of step 2 reads all count rows: the plan (csrc/cuda/launch_plan.h) sizes the
// chunks so that this costs a few reads per choice in all.  The ids are int32 or int64, read in
// place through their strides (a transposed view costs no copy).
#include "tutel_device.cuh"

// The bucket of choice c: its expert, or `experts` when the id lies outside [0, experts).
// Element (t, j) of expert_ids is at t * token_stride + j * choice_stride.
__device__ __forceinline__ int bucket_of(const void* expert_ids, int ids_64bit, i64 token_stride,
                                         i64 choice_stride, i64 k, i64 experts, i64 c) {
  const i64 t = c / k, j = c - t * k;
  const i64 at = t * token_stride + j * choice_stride;
  const i64 id = ids_64bit ? static_cast<const i64*>(expert_ids)[at]
                           : (i64) static_cast<const int*>(expert_ids)[at];
  return id >= 0 && id < experts ? (int)id : (int)experts;
}

// One past the last choice of `chunk`.
__device__ __forceinline__ i64 chunk_end(i64 chunk, i64 chunk_choices, i64 choices) {
  const i64 end = (chunk + 1) * chunk_choices;
  return end < choices ? end : choices;
}

// Step 1: one warp per chunk, 32 choices at a time; the lanes of one bucket find each other
// with __match_any_sync and their lowest lane adds them to the chunk's row.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    count_expert_choices(const void* expert_ids, int ids_64bit, i64 token_stride, i64 choice_stride,
                         i64 tokens, i64 k, i64 experts, i64 chunk_choices, i64 chunks, int* chunk_counts) {
  const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const i64 chunk = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= chunks) return;  // whole warps leave together
  const i64 buckets = experts + 1;
  int* row = chunk_counts + chunk * buckets;
  for (i64 e = lane; e < buckets; e += 32) row[e] = 0;
  __syncwarp();  // the row is zero before any lane adds to it
  const i64 end = chunk_end(chunk, chunk_choices, tokens * k);
  for (i64 base = chunk * chunk_choices; base < end; base += 32) {
    const i64 c = base + lane;
    const bool active = c < end;
    const int bucket = active ? bucket_of(expert_ids, ids_64bit, token_stride, choice_stride, k, experts, c) : 0;
    // Inactive lanes take keys of their own (negative: never a bucket).
    const unsigned peers = __match_any_sync(0xffffffffu, active ? bucket : -1 - (int)lane);
    if (active && lane == (unsigned)(__ffs(peers) - 1)) row[bucket] += __popc(peers);
    __syncwarp();  // this round's addition is seen by the next round's adder of that bucket
  }
}

// In-place exclusive prefix sum of values[0, n) by the whole block (every thread calls it;
// it synchronises); values[n] receives the total.  Thread i scans the i-th of 256 consecutive
// segments, after the sums of the segments before it.
__device__ void block_exclusive_scan(int* values, i64 n) {
  __shared__ int warp_totals[TUTEL_BLOCK_THREADS / 32];
  const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const i64 per_thread = (n + TUTEL_BLOCK_THREADS - 1) / TUTEL_BLOCK_THREADS;
  const i64 first = (i64)threadIdx.x * per_thread;
  const i64 last = first + per_thread < n ? first + per_thread : n;
  int sum = 0;
  for (i64 i = first; i < last; ++i) sum += values[i];
  int inclusive = sum;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int neighbour = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= (unsigned)offset) inclusive += neighbour;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int running = inclusive - sum, total = 0;
  for (unsigned w = 0; w < (blockDim.x >> 5); ++w) {
    if (w < warp) running += warp_totals[w];
    total += warp_totals[w];
  }
  __syncthreads();  // every segment has been summed before any is rewritten
  for (i64 i = first; i < last; ++i) {
    const int value = values[i];
    values[i] = running;
    running += value;
  }
  if (threadIdx.x == 0) values[n] = total;
  __syncthreads();
}

// Step 2.  chunk_next [chunks, experts + 1] receives, for the block's own chunks, the choices
// of each bucket in earlier chunks and then serves as their warps' next free slot (relative to
// the bucket's start).  bucket_scratch holds experts + 2 ints per block when the bucket starts
// do not fit in shared memory.
extern "C" __global__ void __launch_bounds__(TUTEL_BLOCK_THREADS)
    place_expert_choices(const void* expert_ids, int ids_64bit, i64 token_stride, i64 choice_stride,
                         i64 tokens, i64 k, i64 experts, i64 chunk_choices, i64 chunks,
                         const int* chunk_counts, int* chunk_next, int* bucket_scratch, int* locations,
                         i64* slot_choices, i64* sorted_ids, i64* counts, int* ends) {
  __shared__ int shared_starts[TUTEL_GROUP_SHARED_BUCKETS];
  const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const i64 buckets = experts + 1, warps = blockDim.x >> 5;
  const i64 first_chunk = (i64)blockIdx.x * warps;
  int* start = buckets + 1 <= TUTEL_GROUP_SHARED_BUCKETS ? shared_starts
                                                         : bucket_scratch + (i64)blockIdx.x * (buckets + 1);

  // Each bucket's total, and its choices before each of this block's chunks (column e is
  // thread e's: consecutive threads read consecutive ints of a row).
  for (i64 e = threadIdx.x; e < buckets; e += blockDim.x) {
    int running = 0;
    for (i64 chunk = 0; chunk < chunks; ++chunk) {
      if (chunk >= first_chunk && chunk < first_chunk + warps) chunk_next[chunk * buckets + e] = running;
      running += chunk_counts[chunk * buckets + e];
    }
    start[e] = running;
  }
  __syncthreads();  // the totals are complete before the scan reads them
  block_exclusive_scan(start, buckets);
  if (blockIdx.x == 0) {
    for (i64 e = threadIdx.x; e < experts; e += blockDim.x) {
      counts[e] = start[e + 1] - start[e];
      ends[e] = start[e + 1];
    }
  }

  const i64 chunk = first_chunk + warp;
  if (chunk >= chunks) return;  // whole warps leave together, after the block's last barrier
  int* next = chunk_next + chunk * buckets;
  const i64 choices = tokens * k;
  const i64 end = chunk_end(chunk, chunk_choices, choices);
  const unsigned lanes_below = (1u << lane) - 1u;
  for (i64 base = chunk * chunk_choices; base < end; base += 32) {
    const i64 c = base + lane;
    const bool active = c < end;
    const int bucket = active ? bucket_of(expert_ids, ids_64bit, token_stride, choice_stride, k, experts, c) : 0;
    const unsigned peers = __match_any_sync(0xffffffffu, active ? bucket : -1 - (int)lane);
    int slot = 0;
    if (active) slot = start[bucket] + next[bucket] + __popc(peers & lanes_below);
    __syncwarp();  // every lane has read next[bucket] before the bucket's lowest lane moves it on
    if (active && lane == (unsigned)(__ffs(peers) - 1)) next[bucket] += __popc(peers);
    __syncwarp();
    if (active) {
      const i64 t = c / k, j = c - t * k;
      locations[j * tokens + t] = bucket < experts ? slot : (int)choices;
      slot_choices[slot] = c;
      sorted_ids[slot] = bucket;
    }
  }
}
