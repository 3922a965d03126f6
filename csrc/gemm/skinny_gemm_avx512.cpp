// AVX-512 skinny products for float, bfloat16 and float16 (see skinny_gemm.h).
//
// [O, K] (skinny_avx512_dot.h): with 32 vector registers of 16 floats a block of 4 matrix rows by
// 4 token rows keeps 16 sums, so each matrix vector loaded serves four token rows and each token
// vector four matrix rows: the products keep up with PyTorch's AVX-512 GEMM to 32 token rows per
// expert, where the AVX2 blocks (2 x 2 and 2 x 4 on 16 registers of 8) are bound by their loads
// from about 8.  bfloat16 uses the CPU's bfloat16 dot products where it has them
// (skinny_gemm_avx512_bf16.cpp); elsewhere 16-bit values widen to float in registers.
//
// [K, O] (below): strips of 32 outputs whose sums stay in registers for blocks of 6 token rows,
// over chunks of 32 matrix rows.  The AVX2 kernel keeps its sums in memory between matrix rows,
// which bounds it by loads and stores from a few token rows on; walking the matrix in strips
// across whole rows (rather than one strip down all of k: a new page at every matrix row, slower
// than the AVX2 kernel) reads each page of a chunk whole.
//
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its own (maybe-)uninitialized
// warnings flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "skinny_gemm.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "skinny_prefetch.h"

#ifdef TUTEL_HAVE_SKINNY_PREFETCH
#define TUTEL_SKINNY_DOT_TARGET TUTEL_AVX512
#include "skinny_avx512_dot.h"
#endif

namespace tutel {
namespace gemm {

#ifdef TUTEL_HAVE_AVX512_KERNELS
namespace {

// The first n (< 16) lanes.
TUTEL_AVX512 inline __mmask16 first_lanes16(int64_t n) { return __mmask16((1u << n) - 1u); }

// Sixteen elements of T as sixteen floats; load_first reads only the first n < 16 (the rest read
// as zero, so they add nothing to a sum).
template <class T>
struct Wide;

template <>
struct Wide<float> {
  TUTEL_AVX512 static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  TUTEL_AVX512 static __m512 load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes16(n), p); }
};

template <>
struct Wide<bfloat16> {
  TUTEL_AVX512 static __m512 load(const bfloat16* p) {
    return avx512::widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  TUTEL_AVX512 static __m512 load_first(const bfloat16* p, int64_t n) {
    return avx512::widen_bf16(_mm256_maskz_loadu_epi16(first_lanes16(n), p));
  }
};

template <>
struct Wide<float16> {
  TUTEL_AVX512 static __m512 load(const float16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  TUTEL_AVX512 static __m512 load_first(const float16* p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes16(n), p));
  }
};

// The dot-product step of skinny_avx512_dot.h that widens: 16 elements to float, one FMA.
template <class T>
struct WideningDot {
  using Operand = __m512;
  static constexpr int64_t kStep = 16;
  TUTEL_AVX512 static Operand load(const T* p) { return Wide<T>::load(p); }
  TUTEL_AVX512 static Operand load_first(const T* p, int64_t n) { return Wide<T>::load_first(p, n); }
  TUTEL_AVX512 static __m512 madd(__m512 acc, Operand w, Operand x) { return _mm512_fmadd_ps(w, x, acc); }
};

// Where a strip block of the [K, O] walk reads and leaves its sums.
struct StripSums {
  const float* x;  // the token rows as floats
  int64_t x_stride;
  float* carry;  // [rows, width] sums between chunks of k
  int64_t width;
  int64_t o_begin;  // the tile's first output: carry column 0
};

// Outputs [o, o + 16 * NV) of token rows [r, r + NR), the part of their sums over matrix rows
// [k_begin, k_end): the sums stay in registers (16 * NV * NR of them, 12 of the 32 registers for 2 x
// 6) while the strip's part of each matrix row streams past, starting from the bias (or zero) at
// k = 0 and from `sums.carry` after; the last chunk writes the outputs, the others leave the sums in
// `sums.carry`.  With `prefetch` the block asks for the same matrix rows two strips further on.
template <class T, int NV, int NR>
TUTEL_AVX512 void strip_block(const SkinnyProduct<T>& p, int64_t inner, int64_t o, int64_t r, int64_t k_begin,
                              int64_t k_end, const StripSums& sums, bool prefetch) {
  __m512 acc[NR][NV];
  float* carry = sums.carry + r * sums.width + (o - sums.o_begin);
  for (int v = 0; v < NV; ++v) {
    const __m512 start = p.bias ? Wide<T>::load(p.bias + o + 16 * v) : _mm512_setzero_ps();
    for (int j = 0; j < NR; ++j)
      acc[j][v] = k_begin == 0 ? start : _mm512_loadu_ps(carry + j * sums.width + 16 * v);
  }
  const float* x = sums.x + r * sums.x_stride;
  const T* w = p.w + k_begin * p.w_stride + o;
  constexpr int64_t kPrefetchAhead = 2 * 16 * NV;
  for (int64_t k = k_begin; k < k_end; ++k, w += p.w_stride) {
    if (prefetch)
      for (int64_t b = 0; b < 16 * NV * int64_t(sizeof(T)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchAhead) + b, _MM_HINT_T0);
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = Wide<T>::load(w + 16 * v);
    for (int j = 0; j < NR; ++j) {
      const __m512 xb = _mm512_set1_ps(x[j * sums.x_stride + k]);
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_fmadd_ps(wv[v], xb, acc[j][v]);
    }
  }
  if (k_end < inner) {
    for (int j = 0; j < NR; ++j)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(carry + j * sums.width + 16 * v, acc[j][v]);
  } else {
    for (int j = 0; j < NR; ++j)
      for (int v = 0; v < NV; ++v) avx512::store16(p.y + (r + j) * p.y_stride + o + 16 * v, acc[j][v]);
  }
}

// strip_block for NR = rows (1 <= rows <= kRows) chosen at run time.
template <class T, int NV, int kRows>
TUTEL_AVX512 void strip_block_of(int64_t rows, const SkinnyProduct<T>& p, int64_t inner, int64_t o, int64_t r,
                                 int64_t k_begin, int64_t k_end, const StripSums& sums, bool prefetch) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      strip_block_of<T, NV, kRows - 1>(rows, p, inner, o, r, k_begin, k_end, sums, prefetch);
      return;
    }
  }
  strip_block<T, NV, kRows>(p, inner, o, r, k_begin, k_end, sums, prefetch);
}

// Token rows per strip block; matrix rows per chunk of k (a 32-output strip's part of them, 4 KiB in
// float32, stays in L1 while every block of token rows reads it).
constexpr int kStripRows = 6;
constexpr int64_t kStripChunk = 32;

// Up to this many token rows the stream kernel (AVX2: one pass over whole matrix rows, bound by
// the matrix's bandwidth) is kept: at one or two rows it keeps up with the strips or beats them,
// from a few rows on the strips pull ahead (docs/performance.md, "Skinny products").
constexpr int64_t kStreamRows = 2;

// [K, O] from 3 token rows: for each chunk of k, strips of 32 outputs (16 at the end) across the
// tile, each read by every block of 6 token rows with the sums in registers.  Walking a chunk's
// rows strip by strip touches each page of them whole, one strip after another.
template <class T>
TUTEL_AVX512 void inner_by_outputs(const SkinnyProduct<T>& p, int64_t inner, int64_t o_begin, int64_t o_end) {
  const SkinnyKernels<T>* avx2 = avx2_skinny_kernels<T>();
  const int64_t width = (o_end - o_begin) / 16 * 16;
  if (p.rows <= kStreamRows || width == 0 || inner == 0) return avx2->inner_by_outputs(p, inner, o_begin, o_end);
  thread_local std::vector<float> widened, carry;  // reused by every call of this thread
  StripSums sums{nullptr, p.x_stride, nullptr, width, o_begin};
  if constexpr (std::is_same<T, float>::value) {
    sums.x = p.x;
  } else {
    widened.resize(p.rows * inner);
    for (int64_t r = 0; r < p.rows; ++r)
      for (int64_t k = 0; k < inner; ++k) widened[r * inner + k] = Scalar<T>::load(p.x[r * p.x_stride + k]);
    sums.x = widened.data();
    sums.x_stride = inner;
  }
  if (inner > kStripChunk) {
    carry.resize(p.rows * width);
    sums.carry = carry.data();
  }
  for (int64_t k_begin = 0; k_begin < inner; k_begin += kStripChunk) {
    const int64_t k_end = std::min(inner, k_begin + kStripChunk);
    int64_t o = o_begin;
    for (; o + 32 <= o_begin + width; o += 32)
      for (int64_t r = 0; r < p.rows; r += kStripRows)
        strip_block_of<T, 2, kStripRows>(std::min<int64_t>(kStripRows, p.rows - r), p, inner, o, r, k_begin, k_end, sums,
                                         r == 0);
    for (; o < o_begin + width; o += 16)
      for (int64_t r = 0; r < p.rows; r += kStripRows)
        strip_block_of<T, 1, kStripRows>(std::min<int64_t>(kStripRows, p.rows - r), p, inner, o, r, k_begin, k_end, sums,
                                         r == 0);
  }
  if (o_begin + width < o_end) avx2->inner_by_outputs(p, inner, o_begin + width, o_end);  // fewer than 16 left
}

}  // namespace
#endif

template <class T>
const SkinnyKernels<T>* avx512_widening_skinny_kernels() {
#ifdef TUTEL_HAVE_AVX512_KERNELS
  if constexpr (!std::is_same<T, double>::value) {
    const SkinnyKernels<T>* avx2 = avx2_skinny_kernels<T>();  // every CPU with AVX-512 has AVX2
    if (!avx512::cpu_has_avx512() || avx2 == nullptr) return nullptr;
    static const SkinnyKernels<T> kernels{&skinny::outputs_by_inner<T, WideningDot<T>>, &inner_by_outputs<T>, 512, 512};
    return &kernels;
  }
#endif
  return nullptr;
}

template <class T>
const SkinnyKernels<T>* avx512_skinny_kernels() {
#ifdef TUTEL_HAVE_AVX512_KERNELS
  if constexpr (std::is_same<T, bfloat16>::value) {
    const SkinnyKernels<T>* widening = avx512_widening_skinny_kernels<T>();
    if (widening != nullptr && skinny::cpu_has_avx512_bf16()) {
      static const SkinnyKernels<T> paired{skinny::bf16_dot_outputs_by_inner(), widening->inner_by_outputs, 512,
                                           widening->inner_by_outputs_bits};
      return &paired;
    }
  }
#endif
  return avx512_widening_skinny_kernels<T>();
}

#define TUTEL_INSTANTIATE_AVX512_SKINNY(T)                                \
  template const SkinnyKernels<T>* avx512_widening_skinny_kernels<T>(); \
  template const SkinnyKernels<T>* avx512_skinny_kernels<T>();
TUTEL_INSTANTIATE_AVX512_SKINNY(float)
TUTEL_INSTANTIATE_AVX512_SKINNY(double)
TUTEL_INSTANTIATE_AVX512_SKINNY(bfloat16)
TUTEL_INSTANTIATE_AVX512_SKINNY(float16)
#undef TUTEL_INSTANTIATE_AVX512_SKINNY

}  // namespace gemm
}  // namespace tutel
