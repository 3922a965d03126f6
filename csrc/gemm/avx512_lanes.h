// Sixteen floats in an AVX-512 register, the storage types they come from and go to, and the CPU
// check the AVX-512 kernels share (skinny_avx512_dot.h, skinny_gemm_avx512.cpp, tile_gemm_amx.cpp).
//
// As in avx2_lanes.h every function carries its own target attribute, so the files including this
// compile with the baseline flags and their code runs only after cpu_has_avx512().  Functions
// compiled for a wider target (AVX512-BF16, AMX) inline these.
#pragma once

#include "../core/avx2_lanes.h"

#ifdef TUTEL_HAVE_AVX2_KERNELS

#define TUTEL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

namespace tutel {
namespace gemm {
namespace avx512 {

// What the AVX-512 kernels need of the CPU (and of the OS: __builtin_cpu_supports checks that it
// saves the 512-bit state).
inline bool cpu_has_avx512() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return supported;
}

// Sixteen bfloat16 values (their bits) as sixteen floats.
TUTEL_AVX512 inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Sixteen floats stored as T, eight at a time through avx2_lanes.h's stores (16-bit values rounded
// as scalar.h rounds them, NaN written as it writes it).
template <class T>
TUTEL_AVX512 inline void store16(T* p, __m512 v) {
  core::avx2::Lanes<T>::store(p, _mm512_extractf32x8_ps(v, 0));
  core::avx2::Lanes<T>::store(p + 8, _mm512_extractf32x8_ps(v, 1));
}

// bfloat16 stores in one 512-bit pass, rounded as avx2::Lanes<bfloat16>::store rounds (to nearest
// even, NaN as 0x7fc0): the same bits, without splitting the register in halves.
TUTEL_AVX512 inline void store16(core::bfloat16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

}  // namespace avx512
}  // namespace gemm
}  // namespace tutel
#endif
