// Device helpers of the routed decode kernels (decode_experts.cu, quantized_decode.cu): which
// expert a choice goes to and with which weight, the block that serves each expert (the first
// choice routed to it) and the choices it computes in passes, the gated unit's value, and the
// count-and-combine that writes each token's weighted sum once its last choice is done.
// Included after tutel_device.cuh and expert_abi.h (storage_t, acc_t, TutelDecodeRouting).
#pragma once

// The most choices a block computes in one pass (count_and_combine's table of them).
#define TUTEL_DECODE_MAX_PASS 8
#define TUTEL_DECODE_WARPS (TUTEL_BLOCK_THREADS / 32)

// ------------------------------------------------------------- routing --
__device__ __forceinline__ i64 routed_id(const TutelDecodeRouting& r, i64 t, i64 j) {
  const i64 at = t * r.ids_token_stride + j * r.ids_choice_stride;
  return r.ids_int64 ? (i64)((const long long*)r.expert_ids)[at] : (i64)((const int*)r.expert_ids)[at];
}

// The expert of choice `pair` (= t k + j), or -1 when dropped.
__device__ __forceinline__ int expert_of(const TutelDecodeRouting& r, i64 pair) {
  const i64 t = pair / r.k;
  const i64 e = routed_id(r, t, pair - t * r.k);
  return e >= 0 && e < r.experts ? (int)e : -1;
}

__device__ __forceinline__ acc_t routing_weight(const TutelDecodeRouting& r, i64 t, i64 j) {
  if (!r.weights) return acc_t(1);
  const i64 at = t * r.weights_token_stride + j * r.weights_choice_stride;
  switch (r.weights_dtype) {
    case TUTEL_WEIGHTS_FLOAT64: return (acc_t)((const double*)r.weights)[at];
    case TUTEL_WEIGHTS_FLOAT16: return (acc_t)half_to_float(((const unsigned short*)r.weights)[at]);
    case TUTEL_WEIGHTS_BFLOAT16:
      return (acc_t)__uint_as_float((unsigned)((const unsigned short*)r.weights)[at] << 16);
    default: return (acc_t)((const float*)r.weights)[at];
  }
}

__device__ __forceinline__ i64 kept_choices(const TutelDecodeRouting& r, i64 t) {
  i64 kept = 0;
  for (i64 j = 0; j < r.k; ++j) kept += expert_of(r, t * r.k + j) >= 0;
  return kept;
}

// The expert this block serves: that of choice `pair` when no earlier choice has it, else -1
// (also for a dropped choice).  Every thread of the block must call it.
__device__ int served_expert(const TutelDecodeRouting& r, i64 pair) {
  __shared__ int taken;
  const int e = expert_of(r, pair);
  if (threadIdx.x == 0) taken = 0;
  __syncthreads();
  if (e >= 0)
    for (i64 q = threadIdx.x; q < pair; q += TUTEL_BLOCK_THREADS)
      if (expert_of(r, q) == e) taken = 1;  // every writer writes 1
  __syncthreads();
  return e >= 0 && !taken ? e : -1;
}

// Collects into members[] the first (up to `capacity`) choices routed to expert e from choice
// `from` on, in choice order; returns how many and sets *next to the choice after the last one
// collected.  Every thread of the block must call it; all get the same answer.
__device__ int collect_choices(const TutelDecodeRouting& r, int e, i64 from, int capacity, i64* members,
                               i64* next) {
  __shared__ int warp_counts[TUTEL_DECODE_WARPS];
  __shared__ i64 resume;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const i64 pairs = r.tokens * r.k;
  __syncthreads();  // the previous call's members and resume are read
  if (threadIdx.x == 0) resume = pairs;
  int count = 0;
  for (i64 base = from; base < pairs && count < capacity; base += TUTEL_BLOCK_THREADS) {
    const i64 q = base + threadIdx.x;
    const bool match = q < pairs && expert_of(r, q) == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, found = 0;
    for (unsigned w = 0; w < TUTEL_DECODE_WARPS; ++w) {
      if (w < warp) before += warp_counts[w];
      found += warp_counts[w];
    }
    const int rank = count + before + __popc(ballot & ((1u << lane) - 1u));
    if (match && rank < capacity) {
      members[rank] = q;
      if (rank == capacity - 1) resume = q + 1;
    }
    __syncthreads();  // warp_counts is read before the next chunk writes it
    count += found;
  }
  __syncthreads();
  *next = resume;
  return count < capacity ? count : capacity;
}

// ---------------------------------------------------------- gated unit --
__device__ __forceinline__ float acc_exp(float v) { return expf(v); }
__device__ __forceinline__ double acc_exp(double v) { return exp(v); }

__device__ __forceinline__ acc_t gated_value(acc_t g, acc_t u, const TutelDecodeUnit& unit) {
  if (unit.clamped) {  // NaN stays NaN, as in torch.clamp
    const acc_t limit = (acc_t)unit.limit;
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
  }
  u = u + (acc_t)unit.up_offset;
  const acc_t s = acc_t(1) / (acc_t(1) + acc_exp(-(acc_t)unit.alpha * g));
  return u * (g * s);
}

// Work every gate/up block does before it knows whether it serves an expert: zeroing the down
// kernel's counters (grid-stride) and, in the blocks of a token's first choice, the output of
// a token without a kept choice.
__device__ void prepare_outputs(const TutelDecodeRouting& r, int* counters, i64 counter_count, storage_t* out,
                                i64 out_features) {
  const i64 block = (i64)blockIdx.y * gridDim.x + blockIdx.x;
  const i64 stride = (i64)gridDim.x * gridDim.y * TUTEL_BLOCK_THREADS;
  for (i64 c = block * TUTEL_BLOCK_THREADS + threadIdx.x; c < counter_count; c += stride) counters[c] = 0;
  const i64 pair = blockIdx.x;
  if (blockIdx.y != 0 || pair % r.k != 0 || kept_choices(r, pair / r.k) != 0) return;
  for (i64 o = threadIdx.x; o < out_features; o += TUTEL_BLOCK_THREADS) out[(pair / r.k) * out_features + o] = storage_t(0);
}

// Vectors of VEC elements of type T, aligned for 16-byte loads (two of them for 8 floats).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC < 16 ? sizeof(T) * VEC : 16) Lanes {
  T v[VEC];
};

// ----------------------------------------------------------- combining --
// After the block stored y for the pass's choices (features [first, first + width) of each):
// counts them done per (token, tile), and where the count completes a token, writes that
// token's output features: sum_j w[t, j] y[t k + j] over its kept choices in choice order.
__device__ void count_and_combine(const TutelDecodeRouting& r, const i64* members, int count, const acc_t* y,
                                  i64 out_features, i64 first, i64 width, int* counters, storage_t* out) {
  __shared__ int completes[TUTEL_DECODE_MAX_PASS];
  __threadfence();  // this thread's y stores are visible to the block that combines them
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int m = 0; m < count; ++m) {
      const i64 t = members[m] / r.k;
      const int done = atomicAdd(counters + t * gridDim.y + blockIdx.y, 1) + 1;
      completes[m] = done == kept_choices(r, t);
    }
    __threadfence();  // the other blocks' y rows are read after their counts
  }
  __syncthreads();
  for (int m = 0; m < count; ++m) {
    if (!completes[m]) continue;
    const i64 t = members[m] / r.k;
    for (i64 c = threadIdx.x; c < width && first + c < out_features; c += TUTEL_BLOCK_THREADS) {
      acc_t sum = acc_t(0);
      bool any = false;
      for (i64 j = 0; j < r.k; ++j) {
        if (expert_of(r, t * r.k + j) < 0) continue;
        // Volatile: written by other blocks during this kernel, so not from a stale cache.
        const acc_t v = *(const volatile acc_t*)(y + (t * r.k + j) * out_features + first + c);
        const acc_t w = routing_weight(r, t, j);
        sum = any ? sum + w * v : w * v;
        any = true;
      }
      out[t * out_features + first + c] = from_acc(sum);
    }
  }
}
