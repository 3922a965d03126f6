// AVX2 + FMA skinny products for float, bfloat16 and float16 (see skinny_gemm.h).
//
// Register blocks: kOutputsByInner multiplies 4 matrix rows by 2 token rows per pass over k
// (8 accumulators; each matrix vector loaded once serves both token rows), kInnerByOutputs
// streams 4 whole matrix rows at a time past the sums of 4 token rows at a time (see
// stream_tile).  Either way the matrix is read from memory once and stays in L1 while every
// token row uses it; 16-bit values widen to float in registers, so a bfloat16 matrix costs half
// the memory traffic of a float32 one.
#include "skinny_gemm.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../core/avx2_lanes.h"
#include "skinny_prefetch.h"

namespace tutel {
namespace gemm {

#ifdef TUTEL_HAVE_AVX2_KERNELS
namespace {

using core::avx2::Lanes;
using skinny::RowPrefetch;
using skinny::prefetch_ahead;

// Sixteen consecutive elements as two float vectors.  For float and float16 these are elements
// 0..7 and 8..15.  bfloat16 splits one 32-byte load into its even elements (shifted into the
// high half) and its odd ones (masked): half the widening work of two zero-extending loads,
// which bounds these kernels on CPUs with narrow vector units.  Products of two operands split
// alike pair up the same elements, so dot products need no reordering; store2 restores the order.
template <class T>
struct Pairs {
  TUTEL_AVX2_FMA static void load2(const T* p, __m256 v[2]) {
    v[0] = Lanes<T>::load(p);
    v[1] = Lanes<T>::load(p + 8);
  }
  TUTEL_AVX2_FMA static void store2(T* p, const __m256 v[2]) {
    Lanes<T>::store(p, v[0]);
    Lanes<T>::store(p + 8, v[1]);
  }
};

template <>
struct Pairs<bfloat16> {
  TUTEL_AVX2_FMA static void load2(const bfloat16* p, __m256 v[2]) {
    const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32(int(0xffff0000u))));
  }
  TUTEL_AVX2_FMA static void store2(bfloat16* p, const __m256 v[2]) {
    // v[0] = elements 0, 2, .., 14 and v[1] = 1, 3, .., 15: interleave within 128-bit lanes,
    // then gather the lanes in order.
    const __m256 low = _mm256_unpacklo_ps(v[0], v[1]);   // 0 1 2 3 | 8 9 10 11
    const __m256 high = _mm256_unpackhi_ps(v[0], v[1]);  // 4 5 6 7 | 12 13 14 15
    Lanes<bfloat16>::store(p, _mm256_permute2f128_ps(low, high, 0x20));
    Lanes<bfloat16>::store(p + 8, _mm256_permute2f128_ps(low, high, 0x31));
  }
};

TUTEL_AVX2_FMA inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// y[r + j, o + i] for i < NO, j < NR, summing over the matrix rows o + i.  With a single token
// row or a single matrix row each output keeps two accumulators (even and odd halves of a pair),
// so the chains of dependent multiply-adds are short enough to keep the FMA units busy (against
// one accumulator each, bfloat16 gained and float32 was unchanged: docs/performance.md, "Skinny
// products").
template <class T, int NO, int NR>
TUTEL_AVX2_FMA void dot_block(const SkinnyProduct<T>& p, int64_t inner, int64_t o, int64_t r, const RowPrefetch& pf) {
  constexpr int NA = NR == 1 || NO == 1 ? 2 : 1;
  __m256 acc[NO][NR][NA];
  const T* w[NO];
  const T* x[NR];
  for (int i = 0; i < NO; ++i) {
    w[i] = p.w + (o + i) * p.w_stride;
    for (int j = 0; j < NR; ++j)
      for (int a = 0; a < NA; ++a) acc[i][j][a] = _mm256_setzero_ps();
  }
  for (int j = 0; j < NR; ++j) x[j] = p.x + (r + j) * p.x_stride;
  int64_t k = 0;
  for (; k + 16 <= inner; k += 16) {
    __m256 xv[NR][2];
    for (int j = 0; j < NR; ++j) Pairs<T>::load2(x[j] + k, xv[j]);
    for (int i = 0; i < NO; ++i) {
      __m256 wv[2];
      prefetch_ahead(w[i] + k, pf);
      Pairs<T>::load2(w[i] + k, wv);
      for (int j = 0; j < NR; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(wv[0], xv[j][0], acc[i][j][0]);
        acc[i][j][NA - 1] = _mm256_fmadd_ps(wv[1], xv[j][1], acc[i][j][NA - 1]);
      }
    }
  }
  for (int i = 0; i < NO; ++i) {
    for (int j = 0; j < NR; ++j) {
      float sum = horizontal_sum(NA == 1 ? acc[i][j][0] : _mm256_add_ps(acc[i][j][0], acc[i][j][NA - 1]));
      for (int64_t t = k; t < inner; ++t) sum += Scalar<T>::load(x[j][t]) * Scalar<T>::load(w[i][t]);
      if (p.bias) sum += Scalar<T>::load(p.bias[o + i]);
      p.y[(r + j) * p.y_stride + o + i] = Scalar<T>::store(sum);
    }
  }
}

// y[r + j, o + i] for i < NO (1 or 2), j < 4: NO matrix rows by four token rows in one pass over
// k, the token rows loaded one at a time inside the step (2 x 4: 8 sums, 4 matrix and 2 token
// vectors, 14 of the 16 registers).  Each sum keeps dot_block<T, NO, NR>'s accumulators (two for a
// single matrix row, 8 independent chains) and adds its pair's halves in its order, so the
// results are dot_block's bit for bit: a token row's result does not depend on how many rows its
// expert has.
//
// 1 x 4 is for 16-bit data read one matrix row at a time, where each pass widens the matrix row
// again: against token pairs it made bfloat16 markedly faster.  float32 gained at a few rows but
// lost at 16-32 rows of short matrix rows, so it keeps the pairs (docs/performance.md, "Skinny
// products").
template <class T, int NO>
TUTEL_AVX2_FMA void dot_block_x4(const SkinnyProduct<T>& p, int64_t inner, int64_t o, int64_t r,
                                 const RowPrefetch& pf) {
  constexpr int NA = NO == 1 ? 2 : 1;
  __m256 acc[NO][4][NA];
  const T* w[NO];
  const T* x[4];
  for (int i = 0; i < NO; ++i) w[i] = p.w + (o + i) * p.w_stride;
  for (int j = 0; j < 4; ++j) {
    x[j] = p.x + (r + j) * p.x_stride;
    for (int i = 0; i < NO; ++i)
      for (int a = 0; a < NA; ++a) acc[i][j][a] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= inner; k += 16) {
    __m256 wv[NO][2];
    for (int i = 0; i < NO; ++i) {
      prefetch_ahead(w[i] + k, pf);
      Pairs<T>::load2(w[i] + k, wv[i]);
    }
    for (int j = 0; j < 4; ++j) {
      __m256 xv[2];
      Pairs<T>::load2(x[j] + k, xv);
      for (int i = 0; i < NO; ++i) {
        acc[i][j][0] = _mm256_fmadd_ps(wv[i][0], xv[0], acc[i][j][0]);
        acc[i][j][NA - 1] = _mm256_fmadd_ps(wv[i][1], xv[1], acc[i][j][NA - 1]);
      }
    }
  }
  for (int i = 0; i < NO; ++i) {
    for (int j = 0; j < 4; ++j) {
      float sum = horizontal_sum(NA == 1 ? acc[i][j][0] : _mm256_add_ps(acc[i][j][0], acc[i][j][NA - 1]));
      for (int64_t t = k; t < inner; ++t) sum += Scalar<T>::load(x[j][t]) * Scalar<T>::load(w[i][t]);
      if (p.bias) sum += Scalar<T>::load(p.bias[o + i]);
      p.y[(r + j) * p.y_stride + o + i] = Scalar<T>::store(sum);
    }
  }
}

template <class T, int NO>
TUTEL_AVX2_FMA void dot_rows(const SkinnyProduct<T>& p, int64_t inner, int64_t o, const RowPrefetch& pf) {
  int64_t r = 0;
  if constexpr (NO == 1 && sizeof(T) == 2)
    for (; r + 4 <= p.rows; r += 4) dot_block_x4<T, 1>(p, inner, o, r, pf);
  for (; r + 2 <= p.rows; r += 2) dot_block<T, NO, 2>(p, inner, o, r, pf);
  if (r < p.rows) dot_block<T, NO, 1>(p, inner, o, r, pf);
}

// Four matrix rows no longer stay in the L1 cache beside the token rows and the lines prefetched
// for the next rows once they hold this many bytes; dot_rows' second pair of token rows would
// then read them again from further out.  From 4 token rows the 2 x 4 blocks were faster or no
// slower, also for rows of exactly a page (4 of them 16 KiB); with 3 rows (no block of four) this order was
// slower, so it starts at 4 (docs/performance.md, "Skinny products").
constexpr int64_t kFourMatrixRowsInL1 = 16 << 10;

// Matrix rows shorter than a page share it with their neighbours, and four of them read side
// by side walk one page at four places at once, which the hardware prefetchers follow poorly;
// read one after another they are a single forward stream, which was faster for rows under a
// page and unchanged or slower from a page on (docs/performance.md, "Skinny products").  Either
// way each sum is the same float dot product; only the order of its additions can differ (one or
// two accumulators, dot_block).
constexpr int64_t kPageBytes = 4096;
// 16-bit token rows are widened again for every matrix row read alone: past 4 of them that cost
// more than the stream gains, even with the 1 x 4 blocks (dot_block_x4).
constexpr int64_t kFewRowsOf16Bit = 4;

template <class T>
TUTEL_AVX2_FMA void avx2_outputs_by_inner(const SkinnyProduct<T>& p, int64_t inner, int64_t o_begin, int64_t o_end) {
  const RowPrefetch pf = skinny::outputs_by_inner_prefetch(inner * int64_t(sizeof(T)), p.w_stride);
  int64_t o = o_begin;
  if (p.rows >= 4 && 4 * inner * int64_t(sizeof(T)) >= kFourMatrixRowsInL1) {
    // Long matrix rows: each pair of them passes once over four token rows at a time.
    for (; o + 2 <= o_end; o += 2) {
      int64_t r = 0;
      for (; r + 4 <= p.rows; r += 4) dot_block_x4<T, 2>(p, inner, o, r, pf);
      for (; r + 2 <= p.rows; r += 2) dot_block<T, 2, 2>(p, inner, o, r, pf);
      if (r < p.rows) dot_block<T, 2, 1>(p, inner, o, r, pf);
    }
  }
  const bool one_by_one =
      inner * int64_t(sizeof(T)) < kPageBytes && (sizeof(T) == sizeof(float) || p.rows <= kFewRowsOf16Bit);
  if (!one_by_one)
    for (; o + 4 <= o_end; o += 4) dot_rows<T, 4>(p, inner, o, pf);
  for (; o < o_end; ++o) dot_rows<T, 1>(p, inner, o, pf);
}

// acc[j * width + c ..] += sum_{k < NK} xk[j * NK + k] * W[k0 + k, o + c ..] for c < width (a multiple
// of 16), j < NR: NK whole matrix rows per pass, each read front to back.  xk holds the token rows'
// NK elements as floats; they are broadcast from memory (one load each), which leaves the
// registers to the sums.
template <class T, int NK, int NR>
TUTEL_AVX2_FMA void stream_rows(const SkinnyProduct<T>& p, int64_t k0, int64_t o, int64_t width, const float* xk,
                                float* acc, const RowPrefetch& pf) {
  const T* w[NK];
  for (int k = 0; k < NK; ++k) w[k] = p.w + (k0 + k) * p.w_stride + o;
  for (int64_t c = 0; c < width; c += 16) {
    __m256 sum[NR][2];
    for (int j = 0; j < NR; ++j)
      for (int h = 0; h < 2; ++h) sum[j][h] = _mm256_loadu_ps(acc + j * width + c + 8 * h);
    for (int k = 0; k < NK; ++k) {
      __m256 wv[2];
      prefetch_ahead(w[k] + c, pf);
      Pairs<T>::load2(w[k] + c, wv);
      for (int j = 0; j < NR; ++j) {
        const __m256 xb = _mm256_broadcast_ss(xk + j * NK + k);
        for (int h = 0; h < 2; ++h) sum[j][h] = _mm256_fmadd_ps(wv[h], xb, sum[j][h]);
      }
    }
    for (int j = 0; j < NR; ++j)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + j * width + c + 8 * h, sum[j][h]);
  }
}

// Matrix rows [k0, k0 + NK) times token rows [r, r + NR) into their sums.
template <class T, int NK, int NR>
TUTEL_AVX2_FMA void stream_group(const SkinnyProduct<T>& p, int64_t k0, int64_t o, int64_t width, int64_t r,
                                 float* acc, const RowPrefetch& pf) {
  float xk[NR * NK];
  for (int j = 0; j < NR; ++j)
    for (int k = 0; k < NK; ++k) xk[j * NK + k] = Scalar<T>::load(p.x[(r + j) * p.x_stride + k0 + k]);
  stream_rows<T, NK, NR>(p, k0, o, width, xk, acc + r * width, pf);
}

// Matrix rows [k0, k0 + NK) times every token row, four at a time: the NK rows stay in L1 while
// the groups of token rows pass over them.
template <class T, int NK>
TUTEL_AVX2_FMA void stream_all_rows(const SkinnyProduct<T>& p, int64_t k0, int64_t o, int64_t width, float* acc,
                                    const RowPrefetch& pf) {
  int64_t r = 0;
  for (; r + 4 <= p.rows; r += 4) stream_group<T, NK, 4>(p, k0, o, width, r, acc, pf);
  switch (p.rows - r) {
    case 3: stream_group<T, NK, 3>(p, k0, o, width, r, acc, pf); break;
    case 2: stream_group<T, NK, 2>(p, k0, o, width, r, acc, pf); break;
    case 1: stream_group<T, NK, 1>(p, k0, o, width, r, acc, pf); break;
    default: break;
  }
}

// Outputs [o, o + width) (width a multiple of 16) of the [K, O] layout: the matrix rows of the
// tile are read whole and in order, four at a time (one stream the hardware prefetchers
// follow), every token row's float sums wait in `acc`.  Walking the matrix instead in chunks of
// 32 rows x 256-output strips (1 KiB runs at the row stride, kept in cache while every token
// row used them) was slower at every row count from 1 to 32: the prefetchers follow one long
// stream, not 32 short ones (docs/performance.md, "Skinny products").
template <class T>
TUTEL_AVX2_FMA void stream_tile(const SkinnyProduct<T>& p, int64_t inner, int64_t o, int64_t width,
                                std::vector<float>& acc) {
  acc.assign(p.rows * width, 0.f);
  if (p.bias) {  // the sums start from the bias, in Pairs<T> order like every sum here
    for (int64_t c = 0; c < width; c += 16) {
      __m256 start[2];
      Pairs<T>::load2(p.bias + o + c, start);
      for (int64_t j = 0; j < p.rows; ++j) {
        _mm256_storeu_ps(acc.data() + j * width + c, start[0]);
        _mm256_storeu_ps(acc.data() + j * width + c + 8, start[1]);
      }
    }
  }
  const RowPrefetch pf = skinny::inner_by_outputs_prefetch(width * int64_t(sizeof(T)), p.w_stride);
  int64_t k = 0;
  for (; k + 4 <= inner; k += 4) stream_all_rows<T, 4>(p, k, o, width, acc.data(), pf);
  for (; k < inner; ++k) stream_all_rows<T, 1>(p, k, o, width, acc.data(), pf);
  for (int64_t j = 0; j < p.rows; ++j)
    for (int64_t c = 0; c < width; c += 16) {
      const __m256 v[2] = {_mm256_loadu_ps(acc.data() + j * width + c), _mm256_loadu_ps(acc.data() + j * width + c + 8)};
      Pairs<T>::store2(p.y + j * p.y_stride + o + c, v);
    }
}

template <class T>
TUTEL_AVX2_FMA void avx2_inner_by_outputs(const SkinnyProduct<T>& p, int64_t inner, int64_t o_begin, int64_t o_end) {
  thread_local std::vector<float> acc;  // reused: a fresh buffer of 32 rows x wide tiles is a fresh mmap each time
  const int64_t aligned_end = o_begin + (o_end - o_begin) / 16 * 16;
  if (aligned_end > o_begin) stream_tile<T>(p, inner, o_begin, aligned_end - o_begin, acc);
  if (aligned_end < o_end) portable_skinny_kernels<T>().inner_by_outputs(p, inner, aligned_end, o_end);  // < 16 left
}

}  // namespace
#endif

template <class T>
const SkinnyKernels<T>* avx2_skinny_kernels() {
#ifdef TUTEL_HAVE_AVX2_KERNELS
  if constexpr (!std::is_same<T, double>::value) {
    static const SkinnyKernels<T> kernels{&avx2_outputs_by_inner<T>, &avx2_inner_by_outputs<T>, 256, 256};
    if (core::avx2::cpu_has_avx2_fma()) return &kernels;
  }
#endif
  return nullptr;
}

template const SkinnyKernels<float>* avx2_skinny_kernels<float>();
template const SkinnyKernels<double>* avx2_skinny_kernels<double>();
template const SkinnyKernels<bfloat16>* avx2_skinny_kernels<bfloat16>();
template const SkinnyKernels<float16>* avx2_skinny_kernels<float16>();

}  // namespace gemm
}  // namespace tutel
