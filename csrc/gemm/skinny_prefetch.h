// How the vectorised skinny products (skinny_gemm_avx2.cpp, skinny_gemm_avx512.cpp) prefetch the
// matrix they stream: how far ahead, and with which hint.  One policy for every instruction set,
// since it follows the caches, not the arithmetic.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define TUTEL_HAVE_SKINNY_PREFETCH 1

namespace tutel {
namespace gemm {
namespace skinny {

// Both layouts prefetch each matrix row's data from a row further on, at the same column: a
// tile's rows follow one another, so this runs a few KiB ahead of the loads.  The rows are short
// streams (2 KiB for 1024 bfloat16 values) that the hardware prefetchers pick up late; measured on
// Zen 1 (one token row, 8 of 64 experts), 8 rows ahead: [O, K] bfloat16 13 -> 17 GB/s, float32
// with 512-element rows 15 -> 16 GB/s; [K, O] bfloat16 12 -> 16 GB/s (4 token rows: 7.7 -> 9.8),
// float32 unchanged.  Prefetching 1 KiB ahead in the same row gained less (about 10% for [O, K]
// bfloat16).  Prefetches never fault, so reading past the matrix's end is harmless.
constexpr int kPrefetchRowsAhead = 8;

// [O, K] rows longer than 4 KiB are prefetched at most this far ahead (whole rows, at least one):
// 8 rows of 16 or 56 KiB put the lines hundreds of KiB ahead of their use, and those evicted
// before it were read twice.  Measured on Zen 3, 2 threads, 8 experts, each product after a 64 MB
// read (GB/s of matrix read, 8 rows ahead against this bound): float32 [4096, 14336] (Mixtral-8x7B's
// down projection, one row ahead) at 1 / 2 / 4 token rows 32.5 / 34.4 / 30.2 -> 36.5 / 39.1 / 32.5;
// [28672, 4096] (its gate and up, two rows) 28.9 / 36.9 / 33.7 -> 30.0 / 39.4 / 35.2; [1024, 3584]
// 24.5 / 24.5 / 20.4 -> 26.8 / 23.0 / 23.5; bfloat16 [1024, 3584] (four rows) 25.2 / 23.9 / 23.8 ->
// 26.4 / 25.1 / 25.0.  Rows of up to 4 KiB (8 of them within the bound) are unchanged.
constexpr int64_t kPrefetchBytesAhead = 32 << 10;

// Where a kernel prefetches: `ahead` elements past each load, with the non-temporal hint or not.
struct RowPrefetch {
  int64_t ahead;
  bool nta;
};

// The prefetches bring a row in with the non-temporal hint (into L1, past the outer caches)
// when the data in flight between a prefetch and its load fits the L1 cache: a decoding step
// reads every weight once, and keeping them out of L2 / L3 leaves the rest of the step (the
// routing, the activations, the interpreter) in cache.  Measured on Zen 1 (32 KiB L1D): one
// token row, one MoE block through transformers' tutel backend, deepseek-like 2.45 -> 2.02 ms,
// qwen3-like 3.44 -> 3.24 ms; the products alone 0.89-0.97x at 1-2 rows, equal at 4-32.  Beyond
// these windows the lines arrived too early and were evicted before use (1.1-1.2x slower), so
// the T0 hint stays: [O, K] rows up to 32 KiB in flight (8 rows of 1024 floats),
// [K, O] tiles up to 16 KiB (it streams 4 matrix rows at once).
constexpr int64_t kNonTemporalWindowDot = 32 << 10;
constexpr int64_t kNonTemporalWindowStream = 16 << 10;

// The hint is for AMD's cores only.  Intel's cores keep lines prefetched with it out of L2, where
// their own prefetchers would have followed the stream, and the products crawl: measured on an
// Intel Xeon with AVX-512 and AMX, 2 threads, 8 experts, one token row, each product after a
// 600 MB read (GB/s of matrix read, hint -> T0; a plain read of the same bytes 33-46): float32
// [O, K] 1024 x 1024 8.4-9.1 -> 36-40, [K, O] tiles 256 and 512 outputs wide 10.7-11.2 -> 21.6 and
// 7.4-10.1 -> 32.9.  No prefetch at all ran at 30-36 there, so T0 stays.
inline bool nontemporal_hint_pays() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// Prefetches the data `pf.ahead` elements past `load`.
template <class T>
inline void prefetch_ahead(const T* load, const RowPrefetch& pf) {
  const char* address = reinterpret_cast<const char*>(load + pf.ahead);
  if (pf.nta)
    _mm_prefetch(address, _MM_HINT_NTA);
  else
    _mm_prefetch(address, _MM_HINT_T0);
}

// The prefetch of the [O, K] layout for rows of `row_bytes` at row stride `w_stride` elements: 8
// rows ahead, at most kPrefetchBytesAhead (whole rows, at least one).
inline RowPrefetch outputs_by_inner_prefetch(int64_t row_bytes, int64_t w_stride) {
  row_bytes = std::max<int64_t>(1, row_bytes);
  const int64_t rows_ahead = std::max<int64_t>(1, std::min<int64_t>(kPrefetchRowsAhead, kPrefetchBytesAhead / row_bytes));
  return RowPrefetch{rows_ahead * w_stride, nontemporal_hint_pays() && rows_ahead * row_bytes <= kNonTemporalWindowDot};
}

// The prefetch of the [K, O] layout streaming tiles of `tile_bytes` per matrix row.
inline RowPrefetch inner_by_outputs_prefetch(int64_t tile_bytes, int64_t w_stride) {
  const bool in_window = kPrefetchRowsAhead * tile_bytes <= kNonTemporalWindowStream;
  return RowPrefetch{kPrefetchRowsAhead * w_stride, nontemporal_hint_pays() && in_window};
}

}  // namespace skinny
}  // namespace gemm
}  // namespace tutel
#endif
