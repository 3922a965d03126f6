// The [O, K] walk of the AVX-512 skinny products (skinny_gemm_avx512.cpp), on a dot-product step
// `Dot` that says how many elements one multiply-add of a vector of float sums consumes:
//
//   using Operand;                      // what a load gives
//   static constexpr int64_t kStep;     // elements per load
//   static Operand load(const T*);      // kStep elements
//   static Operand load_first(const T*, int64_t n);  // the first n < kStep, the rest zero
//   static __m512 madd(__m512 acc, Operand w, Operand x);
//
// The includer defines TUTEL_SKINNY_DOT_TARGET, the target attribute these functions are compiled
// for (the instruction sets its Dot needs), so that the bfloat16 dot products' instructions are
// compiled only into the file whose kernels run after a check for them.  Everything here has
// internal linkage: no copy compiled for one target is linked in place of another's.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx512_lanes.h"
#include "skinny_gemm.h"
#include "skinny_prefetch.h"

#ifndef TUTEL_SKINNY_DOT_TARGET
#error "define TUTEL_SKINNY_DOT_TARGET before including skinny_avx512_dot.h"
#endif

#define TUTEL_HAVE_AVX512_KERNELS 1
#define TUTEL_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")))

namespace tutel {
namespace gemm {
namespace skinny {

inline bool cpu_has_avx512_bf16() {
  static const bool supported = avx512::cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return supported;
}

// The bfloat16 [O, K] kernel on VDPBF16PS (skinny_gemm_avx512_bf16.cpp); run it only where
// cpu_has_avx512_bf16().
SkinnyKernel<bfloat16> bf16_dot_outputs_by_inner();

namespace {

// A vector's two halves added.
TUTEL_SKINNY_DOT_TARGET inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_extractf32x8_ps(v, 0), _mm512_extractf32x8_ps(v, 1));
}

// The sum of a vector's 16 lanes, halves added pairwise.  (_mm512_reduce_add_ps does the same but
// draws GCC 12's uninitialised-value warnings, as does _mm512_castps512_ps256.)
TUTEL_SKINNY_DOT_TARGET inline float horizontal_sum(__m512 v) {
  const __m256 eight = fold(v);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// The sums of four vectors' lanes, in lanes 0-3: each vector folded to 8 lanes, then pairs of
// neighbours added across the four (a quarter of the instructions of four horizontal_sum).
TUTEL_SKINNY_DOT_TARGET inline __m128 four_sums(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 ab = _mm256_hadd_ps(fold(a), fold(b));
  const __m256 cd = _mm256_hadd_ps(fold(c), fold(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Four 16-bit values of T as four floats (bfloat16: shifted into the high half; float16: converted).
template <class T>
TUTEL_SKINNY_DOT_TARGET inline __m128 load_four(const T* p) {
  const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same<T, bfloat16>::value) return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16));
  return _mm_cvtph_ps(bits);
}

// Four consecutive elements of T as four floats, and back.  Stores go through the AVX2 kernels'
// eight-lane stores (avx2_lanes.h: 16-bit values rounded to nearest even, NaN written as scalar.h
// writes it) into a scratch row, of which the first four elements are copied out.
template <class T>
struct Four {
  TUTEL_SKINNY_DOT_TARGET static __m128 load(const T* p) { return load_four(p); }
  TUTEL_SKINNY_DOT_TARGET static void store(T* p, __m128 v) {
    alignas(32) T lanes[8];
    core::avx2::Lanes<T>::store(lanes, _mm256_zextps128_ps256(v));
    std::memcpy(p, lanes, 4 * sizeof(T));
  }
};

template <>
struct Four<float> {
  TUTEL_SKINNY_DOT_TARGET static __m128 load(const float* p) { return _mm_loadu_ps(p); }
  TUTEL_SKINNY_DOT_TARGET static void store(float* p, __m128 v) { _mm_storeu_ps(p, v); }
};

// The inner dimension goes in chunks of this many bytes of a row: four matrix rows' chunks and
// the chunks of every token row then stay in L1 (48 KiB on the Xeons with AVX-512, 32 on Zen 4)
// while the blocks of token rows pass over them, however long the rows; between chunks each
// block's sums wait in memory.
constexpr int64_t kChunkBytes = 2 << 10;

// y[r + j, o + i] for i < NO, j < NR, the part of their sums over k in [k_begin, k_end): one float
// vector of sums per output, each matrix vector loaded once for the NR token rows and each token
// vector once for the NO matrix rows.  The sums start from zero at k_begin = 0 and from `carry`
// otherwise; with `finish` the block also takes the k tail past k_end (fewer than Dot::kStep
// elements, masked) and writes the outputs, otherwise it leaves its sums in `carry`.  The block asks
// for the matrix data further on of kPrefetchRows of its matrix rows, from `prefetch_first` on
// (dot_all_rows spreads the requests over the blocks that read the same matrix rows).
template <class T, class Dot, int NO, int NR, int kPrefetchRows>
TUTEL_SKINNY_DOT_TARGET void dot_block(const SkinnyProduct<T>& p, int64_t inner, int64_t o, int64_t r, int64_t k_begin,
                                       int64_t k_end, bool finish, float* carry, const RowPrefetch& pf,
                                       int prefetch_first) {
  __m512 acc[NO][NR];
  const T* w[NO];
  const T* x[NR];
  for (int i = 0; i < NO; ++i) {
    w[i] = p.w + (o + i) * p.w_stride;
    for (int j = 0; j < NR; ++j)
      acc[i][j] = k_begin == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(carry + (i * NR + j) * 16);
  }
  for (int j = 0; j < NR; ++j) x[j] = p.x + (r + j) * p.x_stride;
  const T* ahead[kPrefetchRows > 0 ? kPrefetchRows : 1];
  for (int q = 0; q < kPrefetchRows; ++q) ahead[q] = w[prefetch_first + q];
  int64_t k = k_begin;
  for (; k + Dot::kStep <= k_end; k += Dot::kStep) {
    typename Dot::Operand wv[NO];
    for (int q = 0; q < kPrefetchRows; ++q) prefetch_ahead(ahead[q] + k, pf);
    for (int i = 0; i < NO; ++i) wv[i] = Dot::load(w[i] + k);
    for (int j = 0; j < NR; ++j) {
      const typename Dot::Operand xv = Dot::load(x[j] + k);
      for (int i = 0; i < NO; ++i) acc[i][j] = Dot::madd(acc[i][j], wv[i], xv);
    }
  }
  if (!finish) {
    for (int i = 0; i < NO; ++i)
      for (int j = 0; j < NR; ++j) _mm512_storeu_ps(carry + (i * NR + j) * 16, acc[i][j]);
    return;
  }
  if (k < inner) {
    const int64_t n = inner - k;
    typename Dot::Operand wv[NO];
    for (int i = 0; i < NO; ++i) wv[i] = Dot::load_first(w[i] + k, n);
    for (int j = 0; j < NR; ++j) {
      const typename Dot::Operand xv = Dot::load_first(x[j] + k, n);
      for (int i = 0; i < NO; ++i) acc[i][j] = Dot::madd(acc[i][j], wv[i], xv);
    }
  }
  if constexpr (NO == 4) {  // four outputs of a token row at once
    const __m128 bias = p.bias ? Four<T>::load(p.bias + o) : _mm_setzero_ps();
    for (int j = 0; j < NR; ++j) {
      const __m128 sums = four_sums(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
      Four<T>::store(p.y + (r + j) * p.y_stride + o, p.bias ? _mm_add_ps(sums, bias) : sums);
    }
  } else {
    for (int j = 0; j < NR; ++j) {
      for (int i = 0; i < NO; ++i) {
        float sum = horizontal_sum(acc[i][j]);
        if (p.bias) sum += Scalar<T>::load(p.bias[o + i]);
        p.y[(r + j) * p.y_stride + o + i] = Scalar<T>::store(sum);
      }
    }
  }
}

// dot_block for NR = rows (1 <= rows <= kRows) chosen at run time.
template <class T, class Dot, int NO, int kRows, int kPrefetchRows>
TUTEL_SKINNY_DOT_TARGET void dot_block_of(int64_t rows, const SkinnyProduct<T>& p, int64_t inner, int64_t o, int64_t r,
                                          int64_t k_begin, int64_t k_end, bool finish, float* carry,
                                          const RowPrefetch& pf, int prefetch_first) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      dot_block_of<T, Dot, NO, kRows - 1, kPrefetchRows>(rows, p, inner, o, r, k_begin, k_end, finish, carry, pf,
                                                          prefetch_first);
      return;
    }
  }
  dot_block<T, Dot, NO, kRows, kPrefetchRows>(p, inner, o, r, k_begin, k_end, finish, carry, pf, prefetch_first);
}

// Matrix rows [o, o + NO) against every token row: for each chunk of k, blocks of kRows token rows
// (the last one shorter), each with its own sums in `carry` (NO * kRows vectors per block).  Every
// block reads the same matrix rows, the first from memory, so their requests for the data further
// on are spread over the blocks (one matrix row each from the fourth block on, two each for two or
// three blocks): memory then streams while all of them compute, not in bursts during the first,
// which was faster than the first block asking for all (docs/performance.md, "Skinny products").
template <class T, class Dot, int NO, int kRows>
TUTEL_SKINNY_DOT_TARGET void dot_all_rows(const SkinnyProduct<T>& p, int64_t inner, int64_t o, int64_t chunk,
                                          float* carry, const RowPrefetch& pf) {
  const int64_t full_steps = inner / Dot::kStep * Dot::kStep;  // the chunks cover these; the rest is the tail
  const int64_t blocks = (p.rows + kRows - 1) / kRows;
  int64_t k_begin = 0;
  do {
    const int64_t k_end = std::min(full_steps, k_begin + chunk);
    const bool finish = k_end == full_steps;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r = b * kRows, rows = std::min<int64_t>(kRows, p.rows - r);
      float* sums = carry + b * (NO * kRows * 16);
      if constexpr (NO == 4) {
        if (blocks == 1)
          dot_block_of<T, Dot, NO, kRows, 4>(rows, p, inner, o, r, k_begin, k_end, finish, sums, pf, 0);
        else if (blocks <= 3 && b < 2)
          dot_block_of<T, Dot, NO, kRows, 2>(rows, p, inner, o, r, k_begin, k_end, finish, sums, pf, 2 * int(b));
        else if (blocks >= 4 && b < 4)
          dot_block_of<T, Dot, NO, kRows, 1>(rows, p, inner, o, r, k_begin, k_end, finish, sums, pf, int(b));
        else
          dot_block_of<T, Dot, NO, kRows, 0>(rows, p, inner, o, r, k_begin, k_end, finish, sums, pf, 0);
      } else {
        if (b == 0)
          dot_block_of<T, Dot, NO, kRows, NO>(rows, p, inner, o, r, k_begin, k_end, finish, sums, pf, 0);
        else
          dot_block_of<T, Dot, NO, kRows, 0>(rows, p, inner, o, r, k_begin, k_end, finish, sums, pf, 0);
      }
    }
    k_begin = k_end;
  } while (k_begin < full_steps);
}

template <class T, class Dot>
TUTEL_SKINNY_DOT_TARGET void outputs_by_inner(const SkinnyProduct<T>& p, int64_t inner, int64_t o_begin, int64_t o_end) {
  constexpr int64_t kChunk = std::max<int64_t>(Dot::kStep, kChunkBytes / int64_t(sizeof(T)) / Dot::kStep * Dot::kStep);
  constexpr int kRows = 4, kTailRows = 8;  // 16 sums per block either way, of the 32 vector registers
  thread_local std::vector<float> carry;  // reused by every call of this thread
  const int64_t blocks = (p.rows + kRows - 1) / kRows;
  carry.resize(std::max<int64_t>(blocks * 4 * kRows, (p.rows + kTailRows - 1) / kTailRows * 2 * kTailRows) * 16);
  // Rows of one chunk are prefetched whole rows ahead (as the AVX2 kernels do); longer rows one chunk
  // ahead along the row, the order the chunks are read in.
  RowPrefetch pf = skinny::outputs_by_inner_prefetch(inner * int64_t(sizeof(T)), p.w_stride);
  if (inner > kChunk) pf.ahead = kChunk;
  int64_t o = o_begin;
  for (; o + 4 <= o_end; o += 4) dot_all_rows<T, Dot, 4, kRows>(p, inner, o, kChunk, carry.data(), pf);
  for (; o + 2 <= o_end; o += 2) dot_all_rows<T, Dot, 2, kTailRows>(p, inner, o, kChunk, carry.data(), pf);
  for (; o < o_end; ++o) dot_all_rows<T, Dot, 1, kTailRows>(p, inner, o, kChunk, carry.data(), pf);
}

}  // namespace
}  // namespace skinny
}  // namespace gemm
}  // namespace tutel
