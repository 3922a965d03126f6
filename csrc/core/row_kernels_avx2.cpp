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

#include "avx2_lanes.h"

namespace tutel {
namespace core {

#ifdef TUTEL_HAVE_AVX2_KERNELS
namespace {

using avx2::Lanes;

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

}  // namespace
#endif

template <class T>
const RowKernels<T>* avx2_row_kernels() {
#ifdef TUTEL_HAVE_AVX2_KERNELS
  if constexpr (!std::is_same<T, double>::value) {
    // float64 is moved in float64 everywhere; the portable loops serve it.
    static const RowKernels<T> kernels{&avx2_weighted_sum<T>, &avx2_dot<T>};
    if (avx2::cpu_has_avx2()) return &kernels;
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
