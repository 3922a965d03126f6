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
// streams (2 KiB for 1024 bfloat16 values) that the hardware prefetchers pick up late, so reading
// them ahead raised the matrix's read rate, most for bfloat16; prefetching further along the same
// row gained less (docs/performance.md, "Skinny products").  Prefetches never fault, so reading
// past the matrix's end is harmless.
constexpr int kPrefetchRowsAhead = 8;

// [O, K] rows longer than 4 KiB are prefetched at most this far ahead (whole rows, at least one):
// 8 rows of 16 or 56 KiB put the lines hundreds of KiB ahead of their use, and those evicted
// before it were read twice.  With the bound Mixtral-8x7B's long rows read faster; rows of up to
// 4 KiB (8 of them within the bound) are unchanged (docs/performance.md, "Skinny products").
constexpr int64_t kPrefetchBytesAhead = 32 << 10;

// Where a kernel prefetches: `ahead` elements past each load, with the non-temporal hint or not.
struct RowPrefetch {
  int64_t ahead;
  bool nta;
};

// The prefetches bring a row in with the non-temporal hint (into L1, past the outer caches)
// when the data in flight between a prefetch and its load fits the L1 cache: a decoding step
// reads every weight once, and keeping them out of L2 / L3 leaves the rest of the step (the
// routing, the activations, the interpreter) in cache, so a whole decoding call ran faster, not
// only its products.  Beyond these windows the lines arrived too early and were evicted before
// use, so the T0 hint stays there: [O, K] rows up to 32 KiB in flight (8 rows of 1024 floats),
// [K, O] tiles up to 16 KiB (it streams 4 matrix rows at once).  Figures: docs/performance.md,
// "Skinny products".
constexpr int64_t kNonTemporalWindowDot = 32 << 10;
constexpr int64_t kNonTemporalWindowStream = 16 << 10;

// The hint is for AMD's cores only.  Intel's cores keep lines prefetched with it out of L2, where
// their own prefetchers would have followed the stream, and the products crawl: on an Intel Xeon
// they read the matrix at a fraction of the rate they reach with T0, slower even than with no
// prefetch at all, so T0 stays there (docs/performance.md, "Skinny products").
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
