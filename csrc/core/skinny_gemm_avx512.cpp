// AVX-512 skinny products of the [O, K] layout for float, bfloat16 and float16 (see skinny_gemm.h
// and skinny_avx512_dot.h); the [K, O] layout keeps the AVX2 kernel.
//
// With 32 vector registers of 16 floats a block of 4 matrix rows by 4 token rows keeps 16 sums, so
// each matrix vector loaded serves four token rows and each token vector four matrix rows: the
// products keep up with PyTorch's AVX-512 GEMM to 32 token rows per expert, where the AVX2
// blocks (2 x 2 and 2 x 4 on 16 registers of 8) are bound by their loads from about 8.  The [K, O]
// layout's sums wait in memory between matrix rows, so wider vectors gave it nothing measurable
// (Intel Xeon with AVX-512, 2 threads, 4 experts [1024, 2048] after a 600 MB read: 1 / 2 / 4 / 16
// token rows 1.01-1.36 / 1.04-1.37 / 1.20-1.40 / 3.26-3.76 ms against AVX2's 1.13-1.38 / 1.15-1.33
// / 1.24-1.66 / 3.15-3.31).
//
// bfloat16 products use the CPU's bfloat16 dot products where it has them
// (skinny_gemm_avx512_bf16.cpp); elsewhere 16-bit values widen to float in registers.
//
// GCC 12's AVX-512 intrinsics start from undefined vectors, which its own (maybe-)uninitialized
// warnings flag at every inlined use; this file holds nothing else those warnings could catch.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "skinny_gemm.h"

#include <type_traits>

#include "skinny_prefetch.h"

#ifdef TUTEL_HAVE_SKINNY_PREFETCH
#define TUTEL_SKINNY_DOT_TARGET TUTEL_AVX512
#include "skinny_avx512_dot.h"
#endif

namespace tutel {
namespace core {

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
  TUTEL_AVX512 static __m512 widen(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  TUTEL_AVX512 static __m512 load(const bfloat16* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  TUTEL_AVX512 static __m512 load_first(const bfloat16* p, int64_t n) {
    return widen(_mm256_maskz_loadu_epi16(first_lanes16(n), p));
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

}  // namespace
#endif

template <class T>
const SkinnyKernels<T>* avx512_widening_skinny_kernels() {
#ifdef TUTEL_HAVE_AVX512_KERNELS
  if constexpr (!std::is_same<T, double>::value) {
    const SkinnyKernels<T>* avx2 = avx2_skinny_kernels<T>();  // every CPU with AVX-512 has AVX2
    if (!skinny::cpu_has_avx512() || avx2 == nullptr) return nullptr;
    static const SkinnyKernels<T> kernels{&skinny::outputs_by_inner<T, WideningDot<T>>, avx2->inner_by_outputs, 512,
                                          avx2->inner_by_outputs_bits};
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

}  // namespace core
}  // namespace tutel
