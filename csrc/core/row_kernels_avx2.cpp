// AVX2 + F16C row kernels for float, bfloat16 and float16 rows.
//
// Each function carries its own target attribute, so this file compiles with
// the baseline flags and the code only runs after a CPU check.  FMA is
// deliberately not enabled: products and sums are rounded separately, exactly as
// in the portable kernels, which keeps results bitwise identical across CPUs.
// Eight elements per vector; the scalar tails use the same operations as
// row_kernels.cpp.
#include "row_kernels.h"

#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TUTEL_HAVE_AVX2_KERNELS 1
#define TUTEL_AVX2 __attribute__((target("avx2,f16c")))
#endif

namespace tutel {
namespace core {

#ifdef TUTEL_HAVE_AVX2_KERNELS
namespace {

// Loading 8 elements as 8 floats and storing 8 floats back, per storage type.
template <class T>
struct Lanes;

template <>
struct Lanes<float> {
  TUTEL_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  TUTEL_AVX2 static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

template <>
struct Lanes<bfloat16> {
  TUTEL_AVX2 static __m256 load(const bfloat16* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  // Round to nearest even as float_to_bf16 does; NaN lanes become 0x7fc0.
  TUTEL_AVX2 static void store(bfloat16* p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

template <>
struct Lanes<float16> {
  TUTEL_AVX2 static __m256 load(const float16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // The hardware conversion rounds to nearest even with gradual underflow and
  // overflow to infinity, as float_to_fp16 does; only NaN payloads differ, so
  // NaN lanes are replaced by float_to_fp16's sign | 0x7e00.
  TUTEL_AVX2 static void store(float16* p, __m256 v) {
    const __m128i converted = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    const __m256i u = _mm256_castps_si256(v);
    const __m256i canonical = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                              _mm256_set1_epi32(0x7e00));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m128i canonical16 =
        _mm_packus_epi32(_mm256_castsi256_si128(canonical), _mm256_extracti128_si256(canonical, 1));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(is_nan), _mm256_extracti128_si256(is_nan, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_blendv_epi8(converted, canonical16, nan16));
  }
};

template <class T>
TUTEL_AVX2 void avx2_weighted_sum(T* dst, const T* const* rows, const float* weights, int n, int64_t M) {
  using L = Lanes<T>;
  const float w0 = weights ? weights[0] : 1.0f;
  int64_t m = 0;
  for (; m + 32 <= M; m += 32) {
    const __m256 v0 = _mm256_set1_ps(w0);
    __m256 a0 = _mm256_mul_ps(v0, L::load(rows[0] + m));
    __m256 a1 = _mm256_mul_ps(v0, L::load(rows[0] + m + 8));
    __m256 a2 = _mm256_mul_ps(v0, L::load(rows[0] + m + 16));
    __m256 a3 = _mm256_mul_ps(v0, L::load(rows[0] + m + 24));
    for (int i = 1; i < n; ++i) {
      const __m256 w = _mm256_set1_ps(weights ? weights[i] : 1.0f);
      const T* row = rows[i] + m;
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(w, L::load(row)));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(w, L::load(row + 8)));
      a2 = _mm256_add_ps(a2, _mm256_mul_ps(w, L::load(row + 16)));
      a3 = _mm256_add_ps(a3, _mm256_mul_ps(w, L::load(row + 24)));
    }
    L::store(dst + m, a0);
    L::store(dst + m + 8, a1);
    L::store(dst + m + 16, a2);
    L::store(dst + m + 24, a3);
  }
  for (; m + 8 <= M; m += 8) {
    __m256 a = _mm256_mul_ps(_mm256_set1_ps(w0), L::load(rows[0] + m));
    for (int i = 1; i < n; ++i)
      a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(weights ? weights[i] : 1.0f), L::load(rows[i] + m)));
    L::store(dst + m, a);
  }
  for (; m < M; ++m) {
    float a = w0 * Scalar<T>::load(rows[0][m]);
    for (int i = 1; i < n; ++i) a = a + (weights ? weights[i] : 1.0f) * Scalar<T>::load(rows[i][m]);
    dst[m] = Scalar<T>::store(a);
  }
}

template <class T>
TUTEL_AVX2 float avx2_dot(const T* a, const T* b, int64_t M) {
  using L = Lanes<T>;
  static_assert(kDotLanes == 32, "four vectors of eight partial sums");
  __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps(), p2 = _mm256_setzero_ps(), p3 = _mm256_setzero_ps();
  int64_t m = 0;
  for (; m + 32 <= M; m += 32) {
    p0 = _mm256_add_ps(p0, _mm256_mul_ps(L::load(a + m), L::load(b + m)));
    p1 = _mm256_add_ps(p1, _mm256_mul_ps(L::load(a + m + 8), L::load(b + m + 8)));
    p2 = _mm256_add_ps(p2, _mm256_mul_ps(L::load(a + m + 16), L::load(b + m + 16)));
    p3 = _mm256_add_ps(p3, _mm256_mul_ps(L::load(a + m + 24), L::load(b + m + 24)));
  }
  alignas(32) float partial[kDotLanes];
  _mm256_store_ps(partial, p0);
  _mm256_store_ps(partial + 8, p1);
  _mm256_store_ps(partial + 16, p2);
  _mm256_store_ps(partial + 24, p3);
  float tail = 0;
  for (; m < M; ++m) tail = tail + Scalar<T>::load(a[m]) * Scalar<T>::load(b[m]);
  return dot_reduce(partial, tail);
}

bool cpu_has_avx2() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return supported;
}

}  // namespace
#endif

template <class T>
const RowKernels<T>* avx2_row_kernels() {
#ifdef TUTEL_HAVE_AVX2_KERNELS
  if constexpr (!std::is_same<T, double>::value) {
    // float64 is moved in float64 everywhere; the portable loops serve it.
    static const RowKernels<T> kernels{&avx2_weighted_sum<T>, &avx2_dot<T>};
    if (cpu_has_avx2()) return &kernels;
  }
#endif
  return nullptr;
}

template const RowKernels<float>* avx2_row_kernels<float>();
template const RowKernels<double>* avx2_row_kernels<double>();
template const RowKernels<bfloat16>* avx2_row_kernels<bfloat16>();
template const RowKernels<float16>* avx2_row_kernels<float16>();

}  // namespace core
}  // namespace tutel
