// Eight elements of a storage type as eight floats in an AVX2 register, and back.
//
// Shared by the hand-vectorised kernels (row_kernels_avx2.cpp, gated_units_avx2.cpp, and the CPU
// GEMM's gemm/skinny_gemm_avx2.cpp and gemm/avx512_lanes.h).  Every function carries its own
// target attribute, so the files including this compile with the baseline flags and their code
// runs only after a CPU check (cpu_has_avx2()).  16-bit stores round to nearest even and write NaN
// as scalar.h does, so vector and scalar paths agree.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "scalar.h"

#define TUTEL_HAVE_AVX2_KERNELS 1
#define TUTEL_AVX2 __attribute__((target("avx2,f16c")))
#define TUTEL_AVX2_FMA __attribute__((target("avx2,f16c,fma")))

namespace tutel {
namespace core {
namespace avx2 {

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

// Whether this CPU runs AVX2 + F16C code (checked once).
inline bool cpu_has_avx2() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return supported;
}

// Whether it also has fused multiply-add (every AVX2 CPU shipped so far does; checked anyway).
inline bool cpu_has_avx2_fma() {
  static const bool supported = cpu_has_avx2() && __builtin_cpu_supports("fma");
  return supported;
}

}  // namespace avx2
}  // namespace core
}  // namespace tutel
#endif
