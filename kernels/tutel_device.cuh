// Device building blocks shared by tutel's kernels.
//
// NVRTC provides the CUDA built-ins (threadIdx, __shfl_*_sync, atomics, ...),
// so nothing here includes a CUDA header: compiling needs no include path.
//
// A source that works on floating-point data is compiled once per element type,
// selected with one of -DTUTEL_DTYPE_FLOAT32, _FLOAT64, _FLOAT16, _BFLOAT16:
//   storage_t  the bits in memory (16-bit types are raw unsigned shorts);
//   acc_t      the type arithmetic happens in: float for 16-bit data, so
//              bf16/fp16 accumulate in float32, and float64 stays float64.
// Kernels are compiled with --fmad=false: a * b + c rounds twice, exactly like
// the CPU kernels, so data movement and weighted sums match them bit for bit.
#pragma once

#include "kernel_abi.h"

typedef long long i64;
typedef unsigned long long u64;

#if defined(TUTEL_DTYPE_FLOAT32) || defined(TUTEL_DTYPE_FLOAT64)
#if defined(TUTEL_DTYPE_FLOAT32)
typedef float storage_t;
#else
typedef double storage_t;
#endif
typedef storage_t acc_t;
__device__ __forceinline__ acc_t to_acc(storage_t v) { return v; }
__device__ __forceinline__ storage_t from_acc(acc_t v) { return v; }
#define TUTEL_HAS_DTYPE 1

#elif defined(TUTEL_DTYPE_FLOAT16)
typedef unsigned short storage_t;
typedef float acc_t;
// The hardware conversions: exact widening, and IEEE round-to-nearest-even
// narrowing with overflow to infinity and gradual underflow.  PTX is for the
// GPU only: the host-compiled build of the tests (TUTEL_HOST_EMULATION, see
// tests/cpp/kernels_on_cpu) gets the same two conversions from its header.
#ifndef TUTEL_HOST_EMULATION
__device__ __forceinline__ acc_t to_acc(storage_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}
__device__ __forceinline__ storage_t from_acc(acc_t v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
#else
__device__ __forceinline__ acc_t to_acc(storage_t v) { return emulated_cvt_f32_f16(v); }
__device__ __forceinline__ storage_t from_acc(acc_t v) { return emulated_cvt_rn_f16_f32(v); }
#endif
#define TUTEL_HAS_DTYPE 1

#elif defined(TUTEL_DTYPE_BFLOAT16)
typedef unsigned short storage_t;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(storage_t v) { return __uint_as_float((unsigned)v << 16); }
// Round to nearest, ties to even; NaN becomes the quiet NaN 0x7fc0.  Written
// with integer operations so every architecture rounds the same way.
__device__ __forceinline__ storage_t from_acc(acc_t v) {
  const unsigned bits = __float_as_uint(v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (storage_t)0x7fc0u;
  return (storage_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#define TUTEL_HAS_DTYPE 1
#endif

#ifdef TUTEL_HAS_DTYPE
// N consecutive elements, aligned so that one load or store moves them all
// (N * sizeof(storage_t) == 16 gives 16-byte vector accesses).
template <int N>
struct alignas(sizeof(storage_t) * N) Pack {
  storage_t v[N];
};

// Elements per 16-byte access.
#define TUTEL_VECTOR_WIDTH ((int)(16 / sizeof(storage_t)))

// A 16-bit float's value in any variant (routing weights may be float16 whatever the data).
__device__ __forceinline__ float half_to_float(unsigned short bits) {
#ifndef TUTEL_HOST_EMULATION
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
  return f;
#else
  return emulated_cvt_f32_f16(bits);
#endif
}

// Weight (j, t) of a TutelChoiceWeights table (kernel_abi.h) in the accumulation type: a
// float64 weight in a float32-accumulating variant is rounded to nearest, as the CPU's
// static_cast (and Tensor.to) does; every other conversion is exact.
__device__ __forceinline__ acc_t choice_weight(const TutelChoiceWeights& w, i64 j, i64 t) {
  if (!w.data) return acc_t(1);
  const i64 at = j * w.choice_stride + t * w.token_stride;
  switch (w.dtype) {
    case TUTEL_WEIGHTS_FLOAT64: return (acc_t)((const double*)w.data)[at];
    case TUTEL_WEIGHTS_FLOAT16: return (acc_t)half_to_float(((const unsigned short*)w.data)[at]);
    case TUTEL_WEIGHTS_BFLOAT16: return (acc_t)__uint_as_float((unsigned)((const unsigned short*)w.data)[at] << 16);
    default: return (acc_t)((const float*)w.data)[at];
  }
}

// An expert (or group of experts) and the score it is ranked by; index < 0: none yet.
struct Candidate {
  acc_t value;
  int index;
};

// a ranks strictly before b: NaN first, then larger values, equal values (and +0 / -0) to the
// lower index, as the CPU's top-k.  A strict total order, so every lane of a warp agrees on the
// best candidate.
__device__ __forceinline__ bool ranks_before(const Candidate& a, const Candidate& b) {
  const bool a_nan = a.value != a.value;
  const bool b_nan = b.value != b.value;
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

// The best of the candidates the lanes of a whole warp hold (a lane may hold none); every lane
// gets it.
__device__ __forceinline__ Candidate warp_best(Candidate best) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Candidate other{__shfl_xor_sync(0xffffffffu, best.value, offset),
                          __shfl_xor_sync(0xffffffffu, best.index, offset)};
    if (other.index >= 0 && (best.index < 0 || ranks_before(other, best))) best = other;
  }
  return best;
}

// Sort keys for batch-prioritized routing: ascending keys give descending priority, NaN first,
// and -0 equal to +0; a stable sort of them then keeps token order among equal priorities.  The
// key is the value's bits mapped to an order-preserving signed integer (64-bit for float64 data).
#if defined(TUTEL_DTYPE_FLOAT64)
typedef long long sort_key_t;
typedef unsigned long long sort_bits_t;
__device__ __forceinline__ sort_bits_t value_bits(double v) { return (sort_bits_t)__double_as_longlong(v); }
#else
typedef int sort_key_t;
typedef unsigned int sort_bits_t;
__device__ __forceinline__ sort_bits_t value_bits(float v) { return __float_as_uint(v); }
#endif

__device__ __forceinline__ sort_key_t priority_sort_key(acc_t priority) {
  const sort_bits_t sign = (sort_bits_t)1 << (sizeof(sort_bits_t) * 8 - 1);
  const acc_t value = priority + acc_t(0);  // -0 + 0 == +0
  if (value != value) return (sort_key_t)sign;  // the most negative key: NaN claims slots first
  const sort_bits_t bits = value_bits(value);
  const sort_bits_t ascending = (bits & sign) ? ~bits : (bits | sign);  // monotone in value
  return (sort_key_t)(~ascending ^ sign);  // reversed, then offset into the signed range
}
#endif

// Lanes of the calling thread's group when a warp is split into groups of
// `group` (a power of two <= 32) consecutive lanes.
__device__ __forceinline__ unsigned group_lane_mask(int group) {
  if (group >= 32) return 0xffffffffu;
  const unsigned first_lane = (threadIdx.x & 31u) & ~(unsigned)(group - 1);
  return ((1u << group) - 1u) << first_lane;
}

// Sum over a group of lanes (see group_lane_mask).  The butterfly order is
// fixed, so results do not vary from run to run; lane 0 of the group is the
// one that writes it.
template <class A>
__device__ __forceinline__ A group_sum(A value, int group, unsigned mask) {
  for (int offset = group >> 1; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(mask, value, offset, group);
  return value;
}

// Sum over a whole block of TUTEL_BLOCK_THREADS threads, returned to thread 0.
// Every thread of the block must call it (it synchronises).
template <class A>
__device__ A block_sum(A value) {
  __shared__ A warp_sums[TUTEL_BLOCK_THREADS / 32];
  value = group_sum(value, 32, 0xffffffffu);
  if ((threadIdx.x & 31u) == 0) warp_sums[threadIdx.x >> 5] = value;
  __syncthreads();
  A total = A(0);
  if (threadIdx.x == 0)
    for (int w = 0; w < TUTEL_BLOCK_THREADS / 32; ++w) total += warp_sums[w];
  __syncthreads();
  return total;
}

// In-place exclusive prefix sum of `count` values spaced `stride` apart,
// computed by one whole warp and starting from `start`.  Returns start plus the
// sum of all the values.  Used to turn per-chunk counts into starting offsets.
template <class T>
__device__ T warp_exclusive_scan_strided(T* values, i64 count, i64 stride, T start) {
  const unsigned lane = threadIdx.x & 31u;
  T running = start;
  for (i64 base = 0; base < count; base += 32) {
    const i64 at = base + lane;
    const T value = at < count ? values[at * stride] : T(0);
    T inclusive = value;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const T neighbour = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= (unsigned)offset) inclusive += neighbour;
    }
    T exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
    if (lane == 0) exclusive = T(0);
    if (at < count) values[at * stride] = running + exclusive;
    running += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return running;
}

// Slot hand-out for 32 choices at once (a whole warp): each lane whose `expert` is valid takes the
// next free slot of that expert, next[expert], lanes of one expert in lane order, and the expert's
// next free slot moves past them all.  Returns the lane's slot (0 for an invalid lane).  `next` is
// private to the warp (shared memory, or global memory only this warp uses: hence volatile).
__device__ __forceinline__ int claim_slots(volatile int* next, int expert, bool valid) {
  const unsigned lane = threadIdx.x & 31u;
  // Lanes without a valid expert get a key of their own (negative, so it never equals an expert).
  const unsigned peers = __match_any_sync(0xffffffffu, valid ? expert : -1 - (int)lane);
  int slot = 0;
  if (valid) slot = next[expert] + __popc(peers & ((1u << lane) - 1u));
  __syncwarp();  // every lane has read next before the leader moves it on
  if (valid && lane == (unsigned)(__ffs(peers) - 1)) next[expert] += __popc(peers);
  __syncwarp();
  return slot;
}

// Records a bad (choice, token) entry: see TutelErrorRecord in kernel_abi.h.
// The bad entry itself is then treated as dropped by the caller, so no memory
// outside the tensors is ever touched.
__device__ void report_data_error(TutelErrorSink sink, int op, i64 tokens, i64 entry, int code,
                                  int value) {
  if (sink.record == 0) return;
  const u64 owner = atomicCAS(&sink.record->call_id, 0ull, sink.call_id);
  if (owner == 0ull || owner == sink.call_id) {
    // Every thread of the owning launch writes the same two values.
    sink.record->tokens = tokens;
    sink.record->op = op;
    const u64 key = ((u64)entry << 33) | ((u64)code << 32) | (u64)(unsigned)value;
    atomicMin(&sink.record->key, key);
  }
  __threadfence_system();
  *(volatile unsigned int*)sink.flag = 1u;
}

// The expert owning grouped row `row`: the first e with ends[e] > row, or `experts` when the row lies
// past the last expert's rows (ends [experts] non-decreasing int32, each expert's end).
__device__ __forceinline__ i64 expert_of_grouped_row(const int* ends, i64 experts, i64 row) {
  i64 low = 0, high = experts;
  while (low < high) {
    const i64 mid = (low + high) >> 1;
    if ((i64)ends[mid] > row) high = mid; else low = mid + 1;
  }
  return low;
}

// ------------------------------------------------------------ tensor cores --
// One warp-wide matrix product on the tensor cores (sm_80 and later), D = A B + C for A 16 x 16
// (row-major), B 16 x 8 (column-major), C and D 16 x 8 in float32, A and B in bfloat16
// (mma_m16n8k16_bf16) or float16 (mma_m16n8k16_f16).  Every lane of the warp must call it, with
// its fragments as the PTX ISA lays them out ("Matrix Fragments for mma.m16n8k16 with floating
// point type", section 9.7.14.5.8 of the PTX ISA, checked against its text: A's elements a0..a7,
// B's b0..b3, C's c0..c3), with g = lane >> 2 and t = lane & 3, each 32-bit register holding two
// elements, the lower-numbered one in the low 16 bits:
//   a[0] = A(g, 2t .. 2t+1)      a[1] = A(g+8, 2t .. 2t+1)
//   a[2] = A(g, 2t+8 .. 2t+9)    a[3] = A(g+8, 2t+8 .. 2t+9)
//   b[0] = B(2t .. 2t+1, g)      b[1] = B(2t+8 .. 2t+9, g)
//   c[0], c[1] = C(g, 2t), C(g, 2t+1)    c[2], c[3] = C(g+8, 2t), C(g+8, 2t+1)   (d likewise)
// The products of two bfloat16 or float16 numbers are exact in float32; the hardware sums them in
// an order of its own.
#ifndef TUTEL_HOST_EMULATION
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                  const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                 const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}
#else
// The host-compiled build of the tests (tests/cpp/kernels_on_cpu): the same product from the
// fragment layout above, each lane fetching the row of A and the two columns of B its outputs
// need from the lanes that hold them (8 bytes a shuffle), then summing its four outputs in
// float32, k ascending.
template <bool kHalf>
__device__ __forceinline__ float emulated_mma_element(unsigned pair, int high) {
  const unsigned short bits = (unsigned short)(high ? pair >> 16 : pair & 0xffffu);
  return kHalf ? emulated_cvt_f32_f16(bits) : __uint_as_float((unsigned)bits << 16);
}

template <bool kHalf>
__device__ void emulated_mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                      const float (&c)[4]) {
  const unsigned lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
  // row[r][k]: A(g + 8 r, k); col[j][k]: B(k, 2t + j).
  float row[2][16], col[2][16];
  const u64 a_low = (u64)a[0] | ((u64)a[1] << 32), a_high = (u64)a[2] | ((u64)a[3] << 32);
  const u64 b_pair = (u64)b[0] | ((u64)b[1] << 32);
  for (unsigned s = 0; s < 4; ++s) {
    // Lane 4g + s holds A(g, 2s ..), A(g+8, 2s ..) and A(g, 2s+8 ..), A(g+8, 2s+8 ..); lane 4n + s
    // holds B(2s .., n) and B(2s+8 .., n).
    const u64 low = __shfl_sync(0xffffffffu, a_low, (int)(4 * g + s));
    const u64 high = __shfl_sync(0xffffffffu, a_high, (int)(4 * g + s));
    const u64 b0 = __shfl_sync(0xffffffffu, b_pair, (int)(4 * (2 * t) + s));
    const u64 b1 = __shfl_sync(0xffffffffu, b_pair, (int)(4 * (2 * t + 1) + s));
    for (int e = 0; e < 2; ++e) {
      const unsigned k = 2 * s + e;
      row[0][k] = emulated_mma_element<kHalf>((unsigned)low, e);
      row[1][k] = emulated_mma_element<kHalf>((unsigned)(low >> 32), e);
      row[0][k + 8] = emulated_mma_element<kHalf>((unsigned)high, e);
      row[1][k + 8] = emulated_mma_element<kHalf>((unsigned)(high >> 32), e);
      col[0][k] = emulated_mma_element<kHalf>((unsigned)b0, e);
      col[0][k + 8] = emulated_mma_element<kHalf>((unsigned)(b0 >> 32), e);
      col[1][k] = emulated_mma_element<kHalf>((unsigned)b1, e);
      col[1][k + 8] = emulated_mma_element<kHalf>((unsigned)(b1 >> 32), e);
    }
  }
  for (int i = 0; i < 4; ++i) {
    float sum = c[i];
    for (int k = 0; k < 16; ++k) sum += row[i >> 1][k] * col[i & 1][k];
    d[i] = sum;
  }
}
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                  const float (&c)[4]) {
  emulated_mma_m16n8k16<false>(d, a, b, c);
}
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                 const float (&c)[4]) {
  emulated_mma_m16n8k16<true>(d, a, b, c);
}
#endif
